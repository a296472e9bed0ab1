"""Nostr in tests: loopback relays (nostr-sdk LocalRelay in process, nostr-relay as a subprocess),
a D4 client, and their fixtures (a plugin: tests/conftest.py loads it for the nostr and fuzz tests)."""

from __future__ import annotations

import asyncio
import datetime
import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import nostr_sdk as ns
import pytest

from sessiontape.core.runtime import Runtime
from sessiontape.engines.reference import ReferenceEngine
from sessiontape.transports.nostr.settings import Settings
from sessiontape.transports.nostr.worker import D4Worker
from tests.helpers.config import free_port, make_config
from tests.helpers.nostr_relay_config import nostr_relay_config

WAIT_S = 20.0


async def eventually(
    check: Callable[[], Any], within: float = WAIT_S, what: str = "condition"
) -> Any:
    """Poll ``check`` until it returns something truthy; fail after ``timeout``."""
    deadline = time.monotonic() + within
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(0.05)


class LocalRelay:
    def __init__(self, policy: Any = None) -> None:
        self.port = free_port()
        b = (
            ns.LocalRelayBuilder()
            .addr("127.0.0.1")
            .port(self.port)
            .rate_limit(ns.RateLimit(max_reqs=200, notes_per_minute=100_000))
            .default_filter_limit(5000)
            .max_filter_limit(10_000)
        )
        if policy is not None:
            b = b.write_policy(policy)
        self.relay = b.build()
        self.url = f"ws://127.0.0.1:{self.port}"

    async def start(self) -> LocalRelay:
        await self.relay.run()
        return self

    def stop(self) -> None:
        self.relay.shutdown()


@pytest.fixture
async def local_relay() -> AsyncIterator[LocalRelay]:
    ns.uniffi_set_event_loop(asyncio.get_running_loop())
    r = await LocalRelay().start()
    yield r
    r.stop()


class NostrRelayProcess:
    """The independent ``nostr-relay`` package on a free port, with its own SQLite file."""

    def __init__(self, workdir: Path, *, verify_signatures: bool = True) -> None:
        self.port = free_port()
        self.url = f"ws://127.0.0.1:{self.port}"
        self.workdir = workdir
        self.config = workdir / "relay.yaml"
        self.config.write_text(
            json.dumps(nostr_relay_config(workdir, self.port, verify_signatures=verify_signatures))
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        exe = Path(sys.executable).parent / "nostr-relay"
        self.proc = subprocess.Popen(
            [str(exe), "-c", str(self.config), "serve", "--use-uvicorn"],
            cwd=self.workdir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    async def wait_up(self, within: float = 30.0) -> None:
        async def probe() -> bool:
            try:
                _, w = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:
                return False
            w.close()
            return True

        deadline = time.monotonic() + within
        while not await probe():
            assert self.proc is not None and self.proc.poll() is None, "nostr-relay exited"
            if time.monotonic() > deadline:
                raise AssertionError("nostr-relay did not start")
            await asyncio.sleep(0.1)

    def kill(self) -> None:
        """An outage: the relay dies without closing its connections."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


@pytest.fixture
def relay_process(tmp_path: Path) -> Iterator[Callable[..., Awaitable[NostrRelayProcess]]]:
    started: list[NostrRelayProcess] = []

    async def make(verify_signatures: bool = True) -> NostrRelayProcess:
        d = tmp_path / f"relay{len(started)}"
        d.mkdir()
        r = NostrRelayProcess(d, verify_signatures=verify_signatures)
        r.start()
        started.append(r)
        await r.wait_up()
        return r

    yield make
    for r in started:
        r.stop()


class Caller:
    """A D4 client: publishes signed calls and collects what the worker sends back."""

    def __init__(self, worker_pubkey: str) -> None:
        self.keys = ns.Keys.generate()
        self.pubkey = self.keys.public_key().to_hex()
        self.worker_pubkey = worker_pubkey
        self.client = ns.ClientBuilder().build()
        #: event id -> event dict, for everything the worker published
        self.received: dict[str, dict[str, Any]] = {}
        #: event id -> event dict, for everything this caller published
        self.sent: dict[str, dict[str, Any]] = {}
        #: event id -> how many times the client was handed it
        self.deliveries: Counter[str] = Counter()
        self._reader: asyncio.Task[None] | None = None

    async def connect(self, *urls: str) -> Caller:
        opts = ns.RelayOptions().retry_interval(datetime.timedelta(seconds=0.5))
        for u in urls:
            await self.client.add_relay(ns.RelayUrl.parse(u), opts=opts)
        await self.client.connect(datetime.timedelta(seconds=5))
        notes = self.client.notifications()
        f = (
            ns.Filter()
            .author(ns.PublicKey.parse(self.worker_pubkey))
            .kinds([ns.Kind(1), ns.Kind(6050), ns.Kind(7000)])
            .since(ns.Timestamp.from_secs(int(time.time()) - 600))
        )
        await self.client.subscribe(ns.ReqTarget.auto([f]))
        self._reader = asyncio.create_task(self._read(notes))
        return self

    async def _read(self, notes: Any) -> None:
        while True:
            n = await notes.next()
            if n.is_shutdown():
                return
            if n.is_new_event():
                d = json.loads(n.event.as_json())
                self.received[d["id"]] = d
                self.deliveries[d["id"]] += 1

    async def wait_connected(self) -> None:
        async def all_up() -> bool:
            return all(
                r.status() == ns.RelayStatus.CONNECTED
                for r in (await self.client.relays()).values()
            )

        deadline = time.monotonic() + WAIT_S
        while not await all_up():
            assert time.monotonic() < deadline, "caller did not reconnect"
            await asyncio.sleep(0.05)

    def sign(
        self, content: str, tags: list[list[str]], kind: int = 1, created_at: int | None = None
    ) -> Any:
        b = ns.EventBuilder(ns.Kind(kind), content).tags([ns.Tag.parse(t) for t in tags])
        if created_at is not None:
            b = b.custom_created_at(ns.Timestamp.from_secs(created_at))
        return b.finalize(self.keys)

    async def publish(self, event: Any) -> str:
        out = await self.client.send_event(event)
        assert out.success, f"no relay took the event: {out.failed}"
        d = json.loads(event.as_json())
        self.sent[d["id"]] = d
        return str(d["id"])

    async def call(self, function_id: str, body: dict[str, Any] | str, *extra_refs: str) -> str:
        content = body if isinstance(body, str) else json.dumps(body)
        tags = [["e", function_id], *[["e", r] for r in extra_refs]]
        return await self.publish(self.sign(content, tags))

    def replies(self, call_id: str) -> list[dict[str, Any]]:
        """Worker events whose first ``e`` tag is ``call_id``, oldest first, with parsed content."""
        out = []
        for d in self.received.values():
            es = [t[1] for t in d["tags"] if t[0] == "e"]
            if es and es[0] == call_id:
                try:
                    c = json.loads(d["content"])
                except ValueError:
                    c = d["content"]
                out.append({**d, "body": c})
        return sorted(
            out,
            key=lambda d: (
                d["created_at"],
                isinstance(d["body"], dict) and not d["body"].get("partial", False),
                (d["body"].get("total_cost", 0) if isinstance(d["body"], dict) else 0),
            ),
        )

    def final(self, call_id: str) -> dict[str, Any] | None:
        finals = [
            r
            for r in self.replies(call_id)
            if isinstance(r["body"], dict) and not r["body"].get("partial")
        ]
        assert len(finals) <= 1, f"call {call_id} answered {len(finals)} times"
        return finals[0] if finals else None

    async def wait_final(self, call_id: str, within: float = WAIT_S) -> dict[str, Any]:
        result: dict[str, Any] = await eventually(
            lambda: self.final(call_id), within, f"final result of {call_id[:8]}"
        )
        return result

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        await self.client.shutdown()


def call_body(
    prompt: str = "<s>[INST] What is the capital of France? [/INST]", **over: Any
) -> dict[str, Any]:
    """The DDIP's sample call, fixed into valid JSON."""
    args = {
        "prompt": prompt,
        "model": "mistral-7b-instruct-v0.1.Q4_K_M.gguf",
        "temperature": 0.0,
        "top_p": 0.95,
        "top_k": 40,
        "min_p": 0.05,
        "typical_p": 1.0,
        "stop": [],
        "seed": 3283645831608526411,
        "response_format": None,
        "max_tokens": 12,
        "presence_penalty": 0,
        "frequency_penalty": 0,
        "repeat_penalty": 1.0,
        "tfs_z": 1.0,
    }
    args.update(over.pop("args", {}))
    body = {
        "max_iteration_cost": 1000,
        "max_total_cost": 1_000_000,
        "results": 1,
        "version": "0.1.0",
        "args": args,
    }
    body.update(over)
    return body


WorkerFactory = Callable[..., Awaitable[D4Worker]]


@pytest.fixture
async def make_worker(tmp_path: Path) -> AsyncIterator[WorkerFactory]:
    """Start D4 workers (stopped at teardown); the key file is shared so restarts keep the identity."""
    ns.uniffi_set_event_loop(asyncio.get_running_loop())
    key_file = tmp_path / "worker.key"
    key_file.write_text(ns.Keys.generate().secret_key().to_bech32())
    workers: list[D4Worker] = []

    async def make(
        runtime: Runtime, relays: list[str], worker_cls: type[D4Worker] = D4Worker, **options: Any
    ) -> D4Worker:
        opts: dict[str, Any] = {
            "relays": relays,
            "key_file": str(key_file),
            "price_msat": 1000,
            "stream_every_tokens": 4,
            "stream_every_ms": 10_000,
            "stream_gap_ms": 0,
            "default_max_tokens": 12,
            "reconnect_min_s": 0.5,
            "retry_base_s": 0.05,
        }
        opts.update(options)
        w = worker_cls(runtime, Settings.from_options(opts))
        await w.start()
        workers.append(w)
        return w

    yield make
    for w in workers:
        await w.stop(grace=1.0)


async def open_runtime(url: str, step_delay_s: float = 0.0) -> Runtime:
    return await Runtime.create(make_config(url), engine=ReferenceEngine(step_delay_s=step_delay_s))


def chat(reply: dict[str, Any]) -> dict[str, Any]:
    """The ``chat.completion`` a result event carries (its ``result``, parsed)."""
    result: dict[str, Any] = json.loads(reply["body"]["result"])
    return result
