"""HTTP transport fixtures: an in-process ASGI client and a real uvicorn server on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from sessiontape.core.runtime import Runtime
from sessiontape.transports.http.server.app import create_app
from tests.helpers.http import Served, serving


@pytest.fixture
async def client(runtime: Runtime) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(runtime)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test"
    ) as c:
        yield c
    await app.state.api.aclose()


@pytest.fixture
async def server(sqlite_url: str, port: int) -> AsyncIterator[Served]:
    """uvicorn on loopback; the reference engine sleeps 20 ms a step so streams can be cut mid-generation."""
    async with serving(sqlite_url, port, step_delay_s=0.02) as s:
        yield s
