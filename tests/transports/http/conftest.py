"""HTTP transport fixtures: an in-process ASGI client and a real uvicorn server on loopback."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest

from sessiontape.core.engine.interface import Engine
from sessiontape.core.runtime import Runtime
from sessiontape.engines.reference import ReferenceEngine
from sessiontape.transports.http.plugin import HttpTransport
from sessiontape.transports.http.server.app import create_app
from tests.conftest import make_config


@pytest.fixture
async def client(runtime: Runtime) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(runtime)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test"
    ) as c:
        yield c
    await app.state.api.aclose()


@dataclass
class Served:
    runtime: Runtime
    transport: HttpTransport
    url: str


async def serve(
    sqlite_url: str,
    port: int,
    *,
    step_delay_s: float = 0.0,
    engine: Engine | None = None,
    **options: object,
) -> Served:
    """``engine``: the reference engine (sleeping ``step_delay_s`` a step) unless given."""
    cfg = make_config(sqlite_url)
    rt = await Runtime.create(cfg, engine=engine or ReferenceEngine(step_delay_s=step_delay_s))
    tr = HttpTransport(rt, {"listen": f"127.0.0.1:{port}", "heartbeat_s": 1.0, **options}, cfg)
    await tr.start()
    return Served(rt, tr, f"http://127.0.0.1:{port}")


@contextlib.asynccontextmanager
async def serving(
    sqlite_url: str,
    port: int,
    *,
    step_delay_s: float = 0.0,
    engine: Engine | None = None,
    **options: object,
) -> AsyncIterator[Served]:
    """:func:`serve`, stopped (transport, then runtime) however the block ends."""
    s = await serve(sqlite_url, port, step_delay_s=step_delay_s, engine=engine, **options)
    try:
        yield s
    finally:
        await s.transport.stop(grace=1.0)
        await s.runtime.aclose()


@pytest.fixture
async def server(sqlite_url: str, port: int) -> AsyncIterator[Served]:
    """uvicorn on loopback; the reference engine sleeps 20 ms a step so streams can be cut mid-generation."""
    async with serving(sqlite_url, port, step_delay_s=0.02) as s:
        yield s
