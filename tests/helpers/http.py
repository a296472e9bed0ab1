"""A real uvicorn serving a runtime on loopback, as the HTTP tests and the clients' tests start it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from sessiontape.core.engine.interface import Engine
from sessiontape.core.runtime import Runtime
from sessiontape.engines.reference import ReferenceEngine
from sessiontape.transports.http.plugin import HttpTransport
from tests.helpers.config import make_config


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
