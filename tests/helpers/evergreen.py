"""Evergreen exchanges for the gRPC tests: send messages on one stream, read to its end,
and the session's log."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import grpc

from sessiontape.core.events import Event
from sessiontape.core.runtime import Runtime
from sessiontape.transports.grpc.client import EvergreenClient, EvergreenSession, assemble
from sessiontape.transports.grpc.gen.evergreen.v2 import evergreen_pb2

SessionMessage = evergreen_pb2.SessionMessage


@dataclass
class Outcome:
    session_id: str
    received: list[Any]
    code: grpc.StatusCode
    details: str = ""
    events: list[Event] = field(default_factory=list)

    @property
    def nodes(self) -> dict[str, bytes]:
        return assemble(self.received)

    def of(self, *types: str) -> list[Event]:
        return [e for e in self.events if e.type in types]


async def exchange(client: EvergreenClient, runtime: Runtime, *messages: SessionMessage) -> Outcome:
    """Send ``messages``, half-close, read to the end; the status and the session's log."""
    async with client.session() as s:
        sid = await s.session_id()
        code, details = grpc.StatusCode.OK, ""
        try:
            for m in messages:
                await s.call.write(m)
            await s.done_writing()
            await s.collect()
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details() or ""
        received = list(s.received)
    return Outcome(sid, received, code, details, await runtime.log.read(sid, 1, None))


def msg(*, fragments: list[Any] | None = None, actions: list[Any] | None = None) -> SessionMessage:
    return SessionMessage(node_fragments=fragments or [], actions=actions or [])


async def until_calls(s: EvergreenSession) -> list[evergreen_pb2.Action]:
    """Read until the server sends actions (a reply's tool calls); fail if the stream ends
    first."""
    async for m in s:
        if m.actions:
            return list(m.actions)
    raise AssertionError("the stream ended without a call")
