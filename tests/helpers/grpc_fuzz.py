"""The gRPC fuzz tests' server (a plugin: ``grpc_fuzzed``), what they forbid, and what they
compare: every session's stored events before and after a refused call."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import pytest

from sessiontape.core.runtime import Runtime
from sessiontape.engines.reference import ReferenceEngine
from sessiontape.transports.grpc.plugin import GrpcTransport
from tests.helpers.config import make_config
from tests.helpers.fuzz import LoggedErrors

FORBIDDEN = {
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.UNIMPLEMENTED,
}


@dataclass
class Fuzzed:
    runtime: Runtime
    channel: grpc.aio.Channel
    sids: list[str]
    #: what the server logged at ERROR (an internal error's traceback), for a failure's report
    errors: list[str] = field(default_factory=list)
    #: the server's port, for clients other than ``channel``
    port: int = 0


@contextlib.asynccontextmanager
async def fuzzed_server(sqlite_url: str, max_length: int = 256) -> AsyncIterator[Fuzzed]:
    """A gRPC server on the reference engine (contexts of ``max_length`` tokens), with a
    Salience and a Kakeya session holding three tokens each."""
    cfg = make_config(sqlite_url)
    rt = await Runtime.create(cfg, engine=ReferenceEngine(max_length=max_length))
    tr = GrpcTransport(rt, {"listen": "127.0.0.1:0"}, cfg)
    await tr.start()
    sids = [
        (await rt.open_session("salience")).session_id,
        (await rt.open_session("kakeya", mode="append_only")).session_id,
    ]
    for sid in sids:
        await rt.append_tokens(sid, [1, 2, 3])
    errors: list[str] = []
    handler = LoggedErrors(errors)
    server_log = logging.getLogger("sessiontape")
    server_log.addHandler(handler)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{tr.port}") as channel:
            yield Fuzzed(rt, channel, sids, errors, port=tr.port or 0)
    finally:
        server_log.removeHandler(handler)
        await tr.stop(0.5)
        await rt.aclose()


@pytest.fixture
async def grpc_fuzzed(sqlite_url: str) -> AsyncIterator[Fuzzed]:
    async with fuzzed_server(sqlite_url) as f:
        yield f


async def stored(f: Fuzzed) -> str:
    return json.dumps(
        [[e.to_json() for e in await f.runtime.log.read(s)] for s in f.sids], sort_keys=True
    )
