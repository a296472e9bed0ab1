"""Small client-side helpers for the Salience and Kakeya tests (generated stubs only)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc
import pytest

from sessiontape.core.events import Event, T
from sessiontape.core.runtime import Runtime
from sessiontape.engines.reference import IMAGE_PAD
from sessiontape.transports.grpc.gen.salience.v1 import salience_pb2 as spb

#: a valid image block for the reference engine: marker, 8 pads, marker (10 tokens)
IMAGE_BLOCK = [1, *([IMAGE_PAD] * 8), 2]
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 20  # > inline_max_bytes: goes to a blob


async def expect_code(code: grpc.StatusCode, call: Any) -> str:
    """Await a unary call or drain a streaming one; it must fail with ``code``. Returns details."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        if hasattr(call, "__aiter__"):
            async for _ in call:
                pass
        else:
            await call
    assert info.value.code() == code, info.value.details()
    return str(info.value.details())


async def generate(stub: Any, **fields: Any) -> tuple[list[Any], Any]:
    """A Salience Generate: (token messages, done message)."""
    tokens, done = [], None
    async for ev in stub.Generate(spb.GenerateRequest(**fields)):
        assert done is None, "nothing may follow Done"
        if ev.WhichOneof("event") == "token":
            tokens.append(ev.token)
        else:
            done = ev.done
    assert done is not None
    return tokens, done


async def open_with(stub: Any, tokens: Sequence[int], **fields: Any) -> str:
    sid = (await stub.OpenSession(spb.OpenSessionRequest())).session_id
    if tokens or fields:
        await generate(stub, session_id=sid, append_tokens=list(tokens), offset=0, **fields)
    return str(sid)


async def dump(stub: Any, sid: str) -> list[int]:
    return list((await stub.DumpSession(spb.DumpSessionRequest(session_id=sid))).tokens)


async def version(rt: Runtime, sid: str) -> int:
    return (await rt.log.get_session(sid)).version


async def events(rt: Runtime, sid: str, type_: str | None = None) -> list[Event]:
    return [e for e in await rt.log.read(sid) if type_ is None or e.type == type_]


async def wait_finished(rt: Runtime, sid: str, reason: str) -> Event:
    """The session's first ``generation.finished`` with ``reason``, from the log (catch-up, then live)."""
    async with asyncio.timeout(10):
        async for e in rt.reads.subscribe(0, session_id=sid):
            if e.type == T.GENERATION_FINISHED and e.body["finish_reason"] == reason:
                return e
    raise AssertionError("subscription ended")
