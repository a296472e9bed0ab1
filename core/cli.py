"""The ``sessiontape`` command line.

    sessiontape serve [--engine NAME] [--grpc H:P] [--http H:P] [--no-grpc] [--no-http]
                      [--nostr-relay URL ...] [--nostr-key-file F] [--auth-token T]
    sessiontape sessions ls [--json] [--status S] [--limit N]
    sessiontape sessions show ID [--json]
    sessiontape replay ID [--speed X | --instant] [--follow]
    sessiontape audit ID... [--reexecute] [--engine NAME] [--json]
    sessiontape export ID > file.ndjson
    sessiontape import file.ndjson
    sessiontape purge ID... | --older-than-days N
    sessiontape db upgrade

Every subcommand accepts ``--config FILE`` and ``--db URL``. Errors print one
line to stderr and exit non-zero. Plugins add subcommands through the
``sessiontape.commands`` entry-point group (a ``register(subparsers)``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

from core.config import Config
from core.errors import ConfigError, SessiontapeError

log = logging.getLogger("sessiontape")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML config file (default: ./sessiontape.toml if present)")
    p.add_argument("--db", metavar="URL", help="database URL (SQLAlchemy async)")


def load_config(args: argparse.Namespace, extra: dict[str, Any] | None = None) -> Config:
    from pathlib import Path

    overrides: dict[str, Any] = dict(extra or {})
    if getattr(args, "db", None):
        overrides.setdefault("database", {})["url"] = args.db
    path = getattr(args, "config", None)
    if path is None and Path("sessiontape.toml").exists():
        path = "sessiontape.toml"
    return Config.load(path, overrides=overrides)


async def _log_only(args: argparse.Namespace, *, follow: bool = False) -> Any:
    """A log (no engine) for read-only commands."""
    from core.log import EventLog

    cfg = load_config(args)
    return await EventLog.open(cfg.db_url, follow=follow)


# -- serve -------------------------------------------------------------------


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
    return over


async def cmd_serve(args: argparse.Namespace) -> int:
    from core.registry import TRANSPORTS, load
    from core.runtime import Runtime
    from core.transport import Transport

    cfg = load_config(args, serve_overrides(args))
    runtime = await Runtime.create(cfg)
    log.info("log: %s", _redact(cfg.db_url))
    runtime.start_sweeper()
    started: list[Transport] = []
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        for name in cfg.enabled_transports():
            cls = load(TRANSPORTS, name)
            transport: Transport = cls(runtime, cfg.transports[name], cfg)
            line = await transport.start()
            started.append(transport)
            log.info("%s: %s", name, line)
        if not started:
            log.warning("no transport enabled; serving nothing but the TTL sweeper")
        log.info("sessiontape ready (engine %s, pid %d)", runtime.engine.info.name, _pid())
        await stop.wait()
        log.info("shutting down")
    finally:
        for t in reversed(started):
            try:
                await t.stop(float(cfg.transports.get(t.name, {}).get("grace_s", 5.0)))
            except Exception:
                log.exception("stopping %s failed", t.name)
        await runtime.aclose()
    return 0


def _pid() -> int:
    import os

    return os.getpid()


def _redact(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


# -- sessions ----------------------------------------------------------------


async def cmd_sessions_ls(args: argparse.Namespace) -> int:
    log_ = await _log_only(args)
    try:
        rows = await log_.list_sessions(status=args.status, protocol=args.protocol, limit=args.limit)
    finally:
        await log_.close()
    if args.json:
        print(json.dumps([r.to_json() for r in rows], indent=None))
        return 0
    print(f"{'ID':28} {'STATUS':8} {'PROTOCOL':10} {'ENGINE':10} {'TOKENS':>7} {'EVENTS':>7}  PARENT")
    for r in rows:
        print(f"{r.id:28} {r.status:8} {r.protocol:10} {r.engine:10} {r.history_length:>7} {r.event_count:>7}  {r.parent_id or ''}")
    return 0


async def cmd_sessions_show(args: argparse.Namespace) -> int:
    from core.loader import load_state
    from core.replay import render_tokens

    log_ = await _log_only(args)
    try:
        row = await log_.get_session(args.id)
        st = await load_state(log_, args.id)
    finally:
        await log_.close()
    info = row.to_json()
    info.update({
        "mode": st.mode, "tokens": len(st.tokens), "text": render_tokens(st.tokens[-2000:]),
        "generations": [{"id": g.id, "tokens": len(g.tokens), "finish_reason": g.finish_reason}
                        for g in st.generations.values()],
        "nodes": len(st.nodes), "actions": len(st.actions), "feedback": st.feedback,
        "errors": st.errors, "provenance": st.engine, "abort": st.abort,
    })
    if args.json:
        print(json.dumps(info))
        return 0
    for key in ("id", "status", "protocol", "mode", "engine", "model_id", "parent_id", "fork_position",
                "event_count", "tokens", "nodes", "actions"):
        print(f"{key:14} {info[key]}")
    print(f"{'provenance':14} {json.dumps(st.engine)}")
    for g in info["generations"]:
        print(f"{'generation':14} {g['id']} {g['tokens']} tokens, {g['finish_reason']}")
    for f in st.feedback:
        print(f"{'feedback':14} score {f.get('score')} {json.dumps(f)}")
    for e in st.errors:
        print(f"{'error':14} {e.get('code')}: {e.get('message')}")
    if st.abort:
        print(f"{'aborted':14} {st.abort.get('code')}: {st.abort.get('message')}")
    print(f"{'text':14} {info['text']}")
    return 0


# -- replay, audit, export, import ---------------------------------------------


async def cmd_replay(args: argparse.Namespace) -> int:
    from core.replay import replay

    log_ = await _log_only(args, follow=args.follow)
    try:
        await log_.get_session(args.id)
        evs = await log_.read(args.id)
        await replay(evs, sys.stdout, speed=args.speed, instant=args.instant)
        if args.follow:
            last = evs[-1].position if evs else 0
            terminal = {"session.closed", "session.aborted", "session.expired", "session.purged"}
            if not evs or evs[-1].type not in terminal:
                async def live() -> Any:
                    async for e in log_.subscribe(last, args.id):
                        yield e
                        if e.type in terminal:
                            return
                await replay(live(), sys.stdout, instant=True)
    finally:
        await log_.close()
    return 0


async def cmd_audit(args: argparse.Namespace) -> int:
    from core.audit import AuditReport, audit_session
    from core.engine import Engine
    from core.registry import ENGINES, load

    cfg = load_config(args)
    log_ = await _log_only(args)
    engines: dict[str, Engine] = {}

    def engine_for(provenance: Any) -> Engine:
        """The engine a session recorded (or --engine), built once per name."""
        name = args.engine or str(provenance.get("engine") or cfg.engine_name)
        if name not in engines:
            options = cfg.engine_options if name == cfg.engine_name else {}
            engines[name] = load(ENGINES, name)(**options)
        return engines[name]

    reports = []
    try:
        ids = list(args.ids)
        for i, sid in enumerate(ids, 1):
            try:
                report = await audit_session(log_, sid, reexecute=args.reexecute, engine_for=engine_for)
            except SessiontapeError as exc:
                report = AuditReport.failed(sid, str(exc))
            except Exception as exc:  # one bad session never stops the others
                report = AuditReport.failed(sid, f"audit failed: {type(exc).__name__}: {exc}")
            reports.append(report)
            if len(ids) > 1 and not args.json:
                _progress(i, len(ids))
    finally:
        for eng in engines.values():
            await eng.aclose()
        await log_.close()
    if args.json:
        print(json.dumps([r.to_json() for r in reports]))
    else:
        for r in reports:
            mark = "ok" if r.ok else "FAILED"
            extra = f", {r.generations} generations re-run, {len(r.divergences)} diverged" if r.reexecuted else ""
            print(f"{r.session_id}: {mark} (chain {'ok' if r.chain_ok else 'BROKEN'}, invariants "
                  f"{'ok' if r.invariants_ok else 'BROKEN'}{extra})")
            for p in r.problems:
                print(f"  {p}")
            for d in r.divergences:
                print(f"  first divergence in {d['generation_id']} at index {d['index']}: {d['recorded']} != {d['reexecuted']}")
    return 0 if all(r.ok for r in reports) else 1


def _progress(i: int, n: int) -> None:
    width = 30
    done = int(width * i / n)
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n}")
    if i == n:
        sys.stderr.write("\n")
    sys.stderr.flush()


async def cmd_export(args: argparse.Namespace) -> int:
    log_ = await _log_only(args)
    try:
        await log_.get_session(args.id)
        evs = await log_.read(args.id)
    finally:
        await log_.close()
    out = sys.stdout
    for e in evs:
        out.write(json.dumps(e.to_json(), separators=(",", ":")) + "\n")
    return 0


async def cmd_import(args: argparse.Namespace) -> int:
    from core.errors import InvalidEvent
    from core.events import Event
    from core.tokens import length_after

    by_session: dict[str, list[Event]] = {}
    from pathlib import Path

    text = await asyncio.to_thread(Path(args.file).read_text, encoding="utf-8")
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            e = Event.from_json(json.loads(line))
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidEvent(f"{args.file}:{n}: not an exported event ({exc})") from exc
        by_session.setdefault(e.session_id, []).append(e)
    log_ = await _log_only(args)
    try:
        for sid, evs in by_session.items():
            evs.sort(key=lambda e: e.version)
            length = 0
            for e in evs:
                length = length_after(length, e.type, dict(e.body))
            await log_.import_events(evs, index={"history_length": length})
            print(f"imported {sid}: {len(evs)} events")
    finally:
        await log_.close()
    return 0


async def cmd_purge(args: argparse.Namespace) -> int:
    import time

    from core.errors import InvalidParameters

    if not args.ids and args.older_than_days is None:
        raise InvalidParameters("name session ids or --older-than-days N")
    log_ = await _log_only(args)
    try:
        ids = list(args.ids)
        if args.older_than_days is not None:
            cutoff = time.time() - args.older_than_days * 86400
            for status in ("closed", "aborted", "expired"):
                for row in await log_.list_sessions(status=status, limit=1_000_000):
                    if row.last_active_at < cutoff:
                        ids.append(row.id)
        for sid in ids:
            row = await log_.get_session(sid)
            if row.status == "open" and not args.force:
                raise InvalidParameters(f"session {sid} is open; close it first or pass --force")
            tomb = await log_.purge(sid, reason=args.reason)
            print(f"purged {sid}: {tomb.body['through_version']} events, tombstone v{tomb.version}")
    finally:
        await log_.close()
    return 0


async def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from core.log import EventLog
    from migrations.runner import current_revision

    cfg = load_config(args)
    log_ = await EventLog.open(cfg.db_url, migrate=True)
    try:
        async with log_.engine.connect() as conn:
            rev = await conn.run_sync(current_revision)
    finally:
        await log_.close()
    print(f"database at revision {rev}: {_redact(cfg.db_url)}")
    return 0


# -- parser --------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sessiontape", description="Event-sourced session store for generative-AI sessions.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the server with the enabled transports")
    _common(s)
    s.add_argument("--engine", help="engine name (reference, onnx, ...)")
    s.add_argument("--grpc", metavar="HOST:PORT")
    s.add_argument("--http", metavar="HOST:PORT")
    s.add_argument("--no-grpc", action="store_true")
    s.add_argument("--no-http", action="store_true")
    s.add_argument("--nostr-relay", metavar="URL", action="append", default=[])
    s.add_argument("--nostr-key-file", metavar="FILE")
    s.add_argument("--auth-token", metavar="TOKEN")
    s.set_defaults(func=cmd_serve)

    ss = sub.add_parser("sessions", help="list or show sessions").add_subparsers(dest="sub", required=True)
    ls = ss.add_parser("ls", help="list sessions")
    _common(ls)
    ls.add_argument("--json", action="store_true")
    ls.add_argument("--status")
    ls.add_argument("--protocol")
    ls.add_argument("--limit", type=int, default=1000)
    ls.set_defaults(func=cmd_sessions_ls)
    sh = ss.add_parser("show", help="show one session")
    _common(sh)
    sh.add_argument("id")
    sh.add_argument("--json", action="store_true")
    sh.set_defaults(func=cmd_sessions_show)

    r = sub.add_parser("replay", help="re-render a session from the log")
    _common(r)
    r.add_argument("id")
    g = r.add_mutually_exclusive_group()
    g.add_argument("--speed", type=float, default=1.0)
    g.add_argument("--instant", action="store_true")
    r.add_argument("--follow", action="store_true", help="keep following a live session")
    r.set_defaults(func=cmd_replay)

    a = sub.add_parser("audit", help="verify chains and invariants; optionally re-execute generations")
    _common(a)
    a.add_argument("ids", nargs="+", metavar="ID")
    a.add_argument("--reexecute", action="store_true")
    a.add_argument("--engine", help="re-execute on this engine instead of the configured one")
    a.add_argument("--json", action="store_true")
    a.set_defaults(func=cmd_audit)

    e = sub.add_parser("export", help="write a session's events as NDJSON to stdout")
    _common(e)
    e.add_argument("id")
    e.set_defaults(func=cmd_export)

    i = sub.add_parser("import", help="import sessions from an NDJSON export")
    _common(i)
    i.add_argument("file")
    i.set_defaults(func=cmd_import)

    pg = sub.add_parser("purge", help="delete sessions' events, leaving a tombstone the chain verifies from")
    _common(pg)
    pg.add_argument("ids", nargs="*", metavar="ID")
    pg.add_argument("--older-than-days", type=float, metavar="N",
                    help="also purge closed, aborted and expired sessions idle for N days")
    pg.add_argument("--reason", default="retention")
    pg.add_argument("--force", action="store_true", help="purge open sessions too")
    pg.set_defaults(func=cmd_purge)

    d = sub.add_parser("db", help="database maintenance").add_subparsers(dest="sub", required=True)
    up = d.add_parser("upgrade", help="apply migrations")
    _common(up)
    up.set_defaults(func=cmd_db_upgrade)

    _plugin_commands(sub)
    return p


def _plugin_commands(sub: Any) -> None:
    from importlib.metadata import entry_points

    for ep in entry_points(group="sessiontape.commands"):
        try:
            register = ep.load()
        except Exception as exc:
            log.debug("plugin command %s unavailable: %s", ep.name, exc)
            continue
        register(sub)


def _config_level(args: argparse.Namespace) -> str:
    """``[logging] level`` from the config, read before logging starts (INFO when unreadable)."""
    try:
        return str(load_config(args).section("logging").get("level", "INFO"))
    except SessiontapeError:
        return "INFO"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = "DEBUG" if args.verbose else str(_config_level(args))
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr,
    )
    logging.getLogger("alembic").setLevel(logging.WARNING)
    try:
        result = args.func(args)
        if inspect.isawaitable(result):
            result = asyncio.run(result)  # type: ignore[arg-type]
        return int(result or 0)
    except SessiontapeError as exc:
        print(f"sessiontape: error: {exc.message}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    except KeyboardInterrupt:
        return 130
    except OSError as exc:
        print(f"sessiontape: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
