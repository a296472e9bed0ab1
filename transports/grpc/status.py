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
    anything else       -> INTERNAL, "internal error (request id ...)", logged once

Usage in an async servicer::

    try:
        st = await runtime.get(request.session_id)
    except SessiontapeError as exc:
        await abort_with(context, exc)
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from typing import NoReturn

import grpc

from sessiontape.core import errors

log = logging.getLogger("sessiontape.grpc")
_REQUEST_ID = "_sessiontape_request_id"

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
    (errors.LogUnavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.DatabaseInUse, grpc.StatusCode.UNAVAILABLE),
)


def code_for(exc: BaseException) -> grpc.StatusCode:
    """The status code for ``exc``; INTERNAL for anything not in the table."""
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def message_for(exc: BaseException) -> str:
    """The status details: the error's message, prefixed with its stable ``code``.

    The last resort for anything else: ``internal`` with a request id and no
    exception text (which may hold SQL or paths); the exception is logged
    once, with that id, however many times its message is asked for.
    """
    if isinstance(exc, errors.SessiontapeError):
        return f"{exc.code}: {exc.message}"
    rid = getattr(exc, _REQUEST_ID, None)
    if rid is None:
        rid = "req_" + secrets.token_hex(8)
        with contextlib.suppress(AttributeError, TypeError):
            setattr(exc, _REQUEST_ID, rid)
        log.error("internal error request_id=%s", rid, exc_info=exc)
    return f"internal: internal error (request id {rid})"


async def abort_with(
    context: grpc.aio.ServicerContext[object, object], exc: BaseException
) -> NoReturn:
    """End the call with the mapped status and message (raises, never returns)."""
    await context.abort(code_for(exc), message_for(exc))
    raise AssertionError("context.abort returned")  # pragma: no cover - abort always raises
