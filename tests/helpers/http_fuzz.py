"""A served runtime to fuzz over HTTP (the fixture ``fuzzed``), and what it stores."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest

from sessiontape.core.runtime import Runtime
from sessiontape.engines.reference import ReferenceEngine
from sessiontape.transports.http.plugin import HttpTransport
from tests.helpers.config import make_config


@dataclass
class Fuzzed:
    runtime: Runtime
    client: httpx.AsyncClient
    sids: list[str]


@pytest.fixture
async def fuzzed(sqlite_url: str, port: int) -> AsyncIterator[Fuzzed]:
    cfg = make_config(sqlite_url, limits={"max_body_bytes": 64 * 1024, "body_timeout_s": 5.0})
    rt = await Runtime.create(cfg, engine=ReferenceEngine(max_length=256))
    tr = HttpTransport(rt, {"listen": f"127.0.0.1:{port}", "heartbeat_s": 1.0}, cfg)
    await tr.start()
    sids = []
    for protocol in ("http", "salience"):
        st = await rt.open_session(protocol)
        await rt.append_text(st.session_id, "a stored prompt")
        sids.append(st.session_id)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
        yield Fuzzed(rt, client, sids)
    await tr.stop(grace=1.0)
    await rt.aclose()


async def stored(f: Fuzzed) -> bytes:
    """Every stored session, as its events: what must not change when a request is refused."""
    while any(f.runtime.generations.is_running(s) for s in f.sids):  # noqa: ASYNC110 - a cancelled stream's record
        await asyncio.sleep(0.01)
    rows = await f.runtime.log.list_sessions(limit=10_000)
    return json.dumps(
        [[e.to_json() for e in await f.runtime.log.read(r.id)] for r in rows], sort_keys=True
    ).encode()
