"""``sessiontape serve``: run the server with the enabled transports until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from typing import Any

from sessiontape.core import gctune
from sessiontape.core.commands.common import add_common, check_database_url, load_config, redact
from sessiontape.core.config import Config
from sessiontape.core.errors import ConfigError

log = logging.getLogger("sessiontape")


def serve_overrides(args: argparse.Namespace) -> dict[str, Any]:
    t: dict[str, Any] = {}
    if args.grpc:
        t.setdefault("grpc", {})["listen"] = args.grpc
    if args.http:
        t.setdefault("http", {})["listen"] = args.http
    if args.no_grpc:
        t.setdefault("grpc", {})["enabled"] = False
    if args.no_http:
        t.setdefault("http", {})["enabled"] = False
    if args.nostr_relay:
        t.setdefault("nostr", {}).update({"relays": list(args.nostr_relay), "enabled": True})
    if args.nostr_key_file:
        t.setdefault("nostr", {})["key_file"] = args.nostr_key_file
    over: dict[str, Any] = {"transports": t}
    if args.auth_token:
        over["auth"] = {"token": args.auth_token}
    if args.engine:
        over["engine"] = {"name": args.engine}
    if args.model or args.dtype or args.attention:
        engine = over.setdefault("engine", {})
        engine.setdefault("name", "onnx")
        options = engine.setdefault("options", {})
        if args.model:
            options["model"] = args.model
        if args.dtype:
            options["dtype"] = args.dtype
        if args.attention:
            options["attention"] = args.attention
    return over


def cmd_serve(args: argparse.Namespace) -> int:
    cfg = load_config(args, serve_overrides(args))
    check_database_url(cfg.db_url, must_exist=False)
    from sessiontape.core.log.serving_lock import serving

    with (
        serving(cfg.db_url),
        asyncio.Runner(loop_factory=loop_factory(cfg.server.event_loop)) as runner,
    ):
        return runner.run(serve(cfg))


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop ``[server] event_loop`` names: uvloop's, or None for asyncio's own.

    uvloop takes a little off a sequential turn and matches asyncio under load;
    ``auto`` takes it where it is installed.
    """
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError as exc:
        if choice == "uvloop":
            raise ConfigError(
                f'[server] event_loop = "uvloop", but uvloop is not installed: {exc}'
            ) from exc
        return None
    return uvloop.new_event_loop


async def serve(cfg: Config) -> int:
    """Serve ``cfg``'s transports on the running loop until SIGTERM or SIGINT."""
    from sessiontape.core.plugins import TRANSPORTS, load
    from sessiontape.core.runtime import Runtime
    from sessiontape.core.transport import Transport

    runtime = await Runtime.create(cfg)
    log.info("log: %s", redact(cfg.db_url))
    runtime.sessions.start_sweeper()
    started: list[Transport] = []
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    # before any transport accepts a connection: what exists now lives as long as the process
    gctune.apply(cfg.server)
    try:
        for name in cfg.enabled_transports():
            cls = load(TRANSPORTS, name)
            transport: Transport = cls(runtime, cfg.transports[name], cfg)
            line = await transport.start()
            started.append(transport)
            log.info("%s: %s", name, line)
        if not started:
            log.warning("no transport enabled; serving nothing but the TTL sweeper")
        log.info(
            "sessiontape ready (engine %s, pid %d, event loop %s)",
            runtime.engine.info.name,
            _pid(),
            type(asyncio.get_running_loop()).__module__.partition(".")[0],
        )
        await stop.wait()
        log.info("shutting down")
    finally:
        for t in reversed(started):
            try:
                await t.stop(t.grace_s)
            except Exception:
                log.exception("stopping %s failed", t.name)
        await runtime.aclose()
    return 0


def _pid() -> int:
    import os

    return os.getpid()


def register(sub: Any) -> None:
    """Add this group's subcommands to the ``sessiontape`` parser."""
    s = sub.add_parser("serve", help="run the server with the enabled transports")
    add_common(s)
    s.add_argument("--engine", help="engine name (reference, onnx, ...)")
    s.add_argument(
        "--model",
        metavar="SOURCE",
        help="the model the onnx engine serves: a registry name (smollm2-135m-instruct), a "
        ".gguf file, a Hugging Face folder or an imported folder; imported on first use",
    )
    s.add_argument(
        "--dtype",
        choices=("auto", "float32", "float16", "q8", "q4"),
        help="how an imported model's weights are held (default auto: GGUF blocks as they are; "
        "float16 computes in float16, for CUDA)",
    )
    s.add_argument(
        "--attention",
        choices=("auto", "gqa", "masked"),
        help="an imported model's attention: masked (continuous batching of many sessions), "
        "gqa (one fused kernel, no batching) or auto (default: masked where the engine "
        "batches, on the CPU; gqa on CUDA)",
    )
    s.add_argument(
        "--grpc", metavar="HOST:PORT", help="gRPC listen address (default 127.0.0.1:50051)"
    )
    s.add_argument(
        "--http", metavar="HOST:PORT", help="HTTP listen address (default 127.0.0.1:8080)"
    )
    s.add_argument("--no-grpc", action="store_true", help="do not start the gRPC transport")
    s.add_argument("--no-http", action="store_true", help="do not start the HTTP transport")
    s.add_argument(
        "--nostr-relay",
        metavar="URL",
        action="append",
        default=[],
        help="serve D4 calls from this nostr relay (repeatable; enables the nostr transport)",
    )
    s.add_argument(
        "--nostr-key-file", metavar="FILE", help="the D4 worker's secret key (nsec or hex)"
    )
    s.add_argument(
        "--auth-token", metavar="TOKEN", help="require this bearer token on gRPC and HTTP"
    )
    s.add_argument(
        "--log-format",
        choices=("text", "json"),
        help="log lines as text or as one JSON object per line (default: [logging] format, text)",
    )
    s.set_defaults(func=cmd_serve)
