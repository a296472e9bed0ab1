"""What the two token-session services (Salience, Kakeya) share.

Both protocols treat a session that was closed, aborted or expired as gone:
later calls answer NOT_FOUND, never FAILED_PRECONDITION. The core reports a
closed session as :class:`SessionClosed` (right for Evergreen, where a
closed stream is a protocol state), so this module restates it as
:class:`SessionNotFound` before :mod:`sessiontape.transports.grpc.status` maps it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import weakref
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar

from sessiontape.core.constraint import Constraint
from sessiontape.core.errors import (
    InvalidConstraint,
    SessionClosed,
    SessionNotFound,
    SessiontapeError,
)
from sessiontape.core.runtime import Runtime
from sessiontape.core.session.state import SessionState
from sessiontape.core.tokens import check_length
from sessiontape.transports.grpc.status import abort_with

#: The call metadata that carries a Generate's constraint on Kakeya and Salience (their
#: published messages have no field for it): the native wire's ``constraint`` object as
#: JSON, e.g. ``{"json_schema": {...}}``, ``{"regex": "..."}`` or ``{"grammar": "..."}``
#: (docs/protocols/grpc.md, "Constraints").
CONSTRAINT_METADATA = "sessiontape-constraint"


def constraint_of(context: Any) -> Constraint | None:
    """The constraint a call's metadata names, or None; InvalidConstraint when it is not
    one (grpcio bounds the metadata's size: 8 KiB by default)."""
    for key, value in context.invocation_metadata() or ():
        if key != CONSTRAINT_METADATA:
            continue
        try:
            obj = json.loads(value)
        except ValueError:
            raise InvalidConstraint(f"{CONSTRAINT_METADATA} is not JSON") from None
        if not isinstance(obj, dict):
            raise InvalidConstraint(f"{CONSTRAINT_METADATA} must be a JSON object")
        return Constraint.from_wire(obj)
    return None


def token_ids(runtime: Runtime, repeated: Sequence[int]) -> list[int]:
    """A request's repeated token ids as a list, its length checked against the model's
    context first (ContextOverflow), so a 4 MiB list costs no work beyond its parse."""
    check_length(len(repeated), runtime.engine.info.max_length)
    return list(repeated)


async def live_session(runtime: Runtime, session_id: str) -> SessionState:
    """The open session ``session_id``; SessionNotFound when unknown, closed or expired."""
    if not session_id:
        raise SessionNotFound(session_id)
    try:
        return await runtime.live(session_id)
    except SessionClosed as exc:
        raise SessionNotFound(session_id) from exc


@contextlib.asynccontextmanager
async def grpc_errors(context: Any, session_id: str = "") -> AsyncIterator[None]:
    """End the call with the mapped status when a core error escapes the block."""
    try:
        yield
    except SessionClosed:
        await abort_with(context, SessionNotFound(session_id))
    except SessiontapeError as exc:
        await abort_with(context, exc)


E = TypeVar("E")


@contextlib.asynccontextmanager
async def closing(events: AsyncIterator[E]) -> AsyncIterator[AsyncIterator[E]]:
    """Close ``events`` however the block ends: a cancelled client must close the
    runtime's generator, which is what records the generation as cancelled."""
    try:
        yield events
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


def covered(ranges: tuple[tuple[int, int], ...], position: int) -> bool:
    """Whether ``position`` lies in one of the ``(start, end)`` ranges (end exclusive)."""
    return any(start <= position < end for start, end in ranges)


class Generations:
    """The handler tasks of one service's Generate calls, so :meth:`drain` can wait for their
    log records at shutdown. Owned by the service instance (one per server)."""

    def __init__(self) -> None:
        self._tasks: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()

    def track(self) -> None:
        """Called by a Generate handler: the current task is one of them."""
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)

    async def drain(self, limit_s: float) -> None:
        """Wait (up to ``limit_s``) for Generate calls cancelled at shutdown to record their end."""
        me = asyncio.current_task()
        loop = asyncio.get_running_loop()
        pending = [t for t in self._tasks if not t.done() and t is not me and t.get_loop() is loop]
        if pending:
            await asyncio.wait(pending, timeout=limit_s)
