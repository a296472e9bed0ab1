"""A real gRPC server on a free loopback port, backed by a Runtime on a SQLite file.

``serve(token=..., **options)`` starts one GrpcTransport (the entry-point
class ``sessiontape serve`` loads) for the test's ``runtime`` fixture; every
server started is stopped at teardown, before the runtime closes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from sessiontape.core.runtime import Runtime
from sessiontape.transports.grpc.client import EvergreenClient
from sessiontape.transports.grpc.plugin import GrpcTransport
from tests.conftest import make_config


@dataclass
class Served:
    runtime: Runtime
    transport: GrpcTransport
    target: str

    def client(self, token: str | None = None, **kw: Any) -> EvergreenClient:
        return EvergreenClient(self.target, token=token, **kw)


Serve = Callable[..., Awaitable[Served]]


@pytest.fixture
async def serve(runtime: Runtime, sqlite_url: str) -> AsyncIterator[Serve]:
    started: list[GrpcTransport] = []

    async def start(token: str = "", **options: Any) -> Served:
        cfg = make_config(sqlite_url, auth={"token": token})
        transport = GrpcTransport(runtime, {"listen": "127.0.0.1:0", **options}, cfg)
        await transport.start()
        started.append(transport)
        return Served(runtime, transport, f"127.0.0.1:{transport.port}")

    yield start
    for t in started:
        await t.stop(0.5)


@pytest.fixture
async def server(serve: Serve) -> Served:
    return await serve()


@pytest.fixture
async def client(server: Served) -> AsyncIterator[EvergreenClient]:
    async with server.client() as c:
        yield c
