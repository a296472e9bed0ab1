"""A real gRPC server on loopback (sessiontape.transports.grpc.plugin) over a Runtime on a
SQLite file, with clients built from the generated stubs only.

``serve`` starts one (``await serve(engine=..., options=...)``); at teardown
the server stops, and every session in the log must replay (``runtime.sessions.load``)
to the state the server held and its hash chain must verify.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from sessiontape.core.engine.interface import Engine
from sessiontape.core.log.store import verify_chain
from sessiontape.core.runtime import Runtime
from sessiontape.engines.reference import ReferenceEngine
from sessiontape.transports.grpc.gen.kakeya.v1 import runtime_pb2_grpc as kakeya_grpc
from sessiontape.transports.grpc.gen.salience.v1 import salience_pb2_grpc as salience_grpc
from sessiontape.transports.grpc.plugin import GrpcTransport
from tests.conftest import make_config

TOKEN = "s3cret-token"


class FakeClock:
    """An injectable wall clock for TTL tests: starts at the real time, moves only when told."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _with_token(details: Any, token: str) -> Any:
    md = grpc.aio.Metadata(*(tuple(details.metadata) if details.metadata else ()))
    md.add("authorization", f"Bearer {token}")
    return details._replace(metadata=md)


# grpc.aio files an interceptor under its first matching kind only: one class per kind
class _BearerUnary(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_token(details, self.token), request)


class _BearerStream(grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_token(details, self.token), request)


@dataclass
class Served:
    runtime: Runtime
    transport: GrpcTransport
    address: str
    clock: FakeClock
    salience: Any
    kakeya: Any
    channels: list[grpc.aio.Channel] = field(default_factory=list)

    def channel(self, token: str | None = TOKEN) -> grpc.aio.Channel:
        interceptors = [_BearerUnary(token), _BearerStream(token)] if token is not None else []
        ch = grpc.aio.insecure_channel(self.address, interceptors=interceptors)
        self.channels.append(ch)
        return ch

    def salience_stub(self, token: str | None = TOKEN) -> Any:
        return salience_grpc.SalienceStub(self.channel(token))

    def kakeya_stub(self, token: str | None = TOKEN) -> Any:
        return kakeya_grpc.RuntimeServiceStub(self.channel(token))


Serve = Callable[..., Awaitable[Served]]


@pytest.fixture
async def serve(sqlite_url: str, port: int) -> AsyncIterator[Serve]:
    started: list[Served] = []

    async def start(
        engine: Engine | None = None,
        options: Mapping[str, Any] | None = None,
        sessions: Mapping[str, Any] | None = None,
    ) -> Served:
        assert not started, "one server per test"
        grpc_opts = {
            "enabled": True,
            "listen": f"127.0.0.1:{port}",
            "grace_s": 1.0,
            **(options or {}),
        }
        overrides: dict[str, Any] = {"auth": {"token": TOKEN}, "transports": {"grpc": grpc_opts}}
        if sessions:
            overrides["sessions"] = dict(sessions)
        config = make_config(sqlite_url, **overrides)
        clock = FakeClock()
        # Salience cannot pin a seed, so by default the engine never samples
        # EOS: token counts are exact whichever seed the runtime draws.
        engine = engine or ReferenceEngine(eos_bias=-100.0)
        rt = await Runtime.create(config, engine=engine, clock=clock)
        transport = GrpcTransport(rt, config.transports["grpc"], config)
        await transport.start()
        served = Served(rt, transport, f"127.0.0.1:{transport.port}", clock, None, None)
        served.salience = served.salience_stub()
        served.kakeya = served.kakeya_stub()
        started.append(served)
        return served

    yield start

    for s in started:
        for ch in s.channels:
            await ch.close()
        await s.transport.stop(1.0)
        try:
            await check_replay(s.runtime)
        finally:
            await s.runtime.aclose()


async def check_replay(rt: Runtime) -> None:
    """Every session replays from the log to the state the server held, and its chain verifies."""
    for row in await rt.log.list_sessions(limit=100_000):
        verify_chain(await rt.log.read(row.id))
        replayed = await rt.sessions.load(row.id)
        live = await rt.get(row.id)
        assert list(replayed.tokens) == list(live.tokens), row.id
        assert replayed.status == live.status, row.id
        assert replayed.version == live.version == row.version, row.id
        assert [(i.start, i.end, i.sha256) for i in replayed.images] == [
            (i.start, i.end, i.sha256) for i in live.images
        ]
        assert row.history_length == replayed.length, row.id
