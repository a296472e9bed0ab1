"""The one place core errors become gRPC status codes.

Every servicer in this package ends a call through :func:`abort_with` (or
:func:`code_for` when it builds the status itself), so a condition reads the
same over Evergreen, Salience and Kakeya::

    NotFound            -> NOT_FOUND
    InvalidArgument     -> INVALID_ARGUMENT
    FailedPrecondition  -> FAILED_PRECONDITION
    ResourceExhausted   -> RESOURCE_EXHAUSTED
    Aborted             -> ABORTED            (SessionBusy, ConcurrencyError)
    Unauthenticated     -> UNAUTHENTICATED
    anything else       -> INTERNAL

Usage in an async servicer::

    try:
        st = await runtime.get(request.session_id)
    except SessiontapeError as exc:
        await abort_with(context, exc)
"""

from __future__ import annotations

from typing import NoReturn

import grpc

from core import errors

_CODES: tuple[tuple[type[errors.SessiontapeError], grpc.StatusCode], ...] = (
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Aborted, grpc.StatusCode.ABORTED),
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (errors.InvalidEvent, grpc.StatusCode.DATA_LOSS),
    (errors.ChainBroken, grpc.StatusCode.DATA_LOSS),
    (errors.LogClosed, grpc.StatusCode.UNAVAILABLE),
)


def code_for(exc: BaseException) -> grpc.StatusCode:
    """The status code for ``exc``; INTERNAL for anything not in the table."""
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def message_for(exc: BaseException) -> str:
    """The status details: the error's message, prefixed with its stable ``code``."""
    if isinstance(exc, errors.SessiontapeError):
        return f"{exc.code}: {exc.message}"
    # Unexpected failures keep their type but not internals beyond the message.
    return f"internal: {type(exc).__name__}: {exc}"


async def abort_with(context: grpc.aio.ServicerContext[object, object], exc: BaseException) -> NoReturn:
    """End the call with the mapped status and message (raises, never returns)."""
    await context.abort(code_for(exc), message_for(exc))
    raise AssertionError("context.abort returned")  # pragma: no cover - abort always raises
