"""The one mapping from core errors to HTTP: status code + ``{"error": {"code", "message"}}``.

The most specific class listed wins (the exception's MRO is walked), so a
new core error inherits its family's status until it is listed here.
:class:`LastResort` answers everything else: a 500 whose body names only a
request id, logged once with that id (docs/security.md).
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sessiontape.core import errors as E
from sessiontape.core import metrics
from sessiontape.transports.http.server.json_encoding import JSONResponse

log = logging.getLogger("sessiontape.http")
REQUEST_ID = "sessiontape.request_id"


class PayloadTooLarge(E.ResourceExhausted):
    """The request body (or a free-form part of it) is over its configured limit."""

    code = "payload_too_large"


class RequestTimeout(E.InvalidArgument):
    """The body stopped arriving for longer than ``limits.body_timeout_s``."""

    code = "request_timeout"


class ClientGone(E.Aborted):
    """The client disconnected before its body arrived: nobody is left to answer."""

    code = "client_closed_request"


STATUS: dict[type[E.SessiontapeError], int] = {
    PayloadTooLarge: 413,
    RequestTimeout: 408,
    ClientGone: 499,
    E.NotFound: 404,
    E.InvalidArgument: 400,
    E.FailedPrecondition: 409,
    E.ContextOverflow: 413,
    E.ResourceExhausted: 429,
    E.Aborted: 409,
    E.Unauthenticated: 401,
    E.ChainBroken: 500,
    E.InvalidEvent: 500,
    E.LogClosed: 503,
    E.LogUnavailable: 503,
    E.DatabaseInUse: 503,
    E.ConfigError: 500,
    E.EngineError: 502,
    E.SessiontapeError: 500,
}


def status_for(exc: E.SessiontapeError) -> int:
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 500


def error_body(code: str, message: str, **extra: Any) -> dict[str, dict[str, Any]]:
    return {"error": {"code": code, "message": message, **extra}}


def error_response(
    code: str, message: str, status: int, headers: dict[str, str] | None = None, **extra: Any
) -> JSONResponse:
    metrics.ERRORS.labels(code).inc()
    return JSONResponse(error_body(code, message, **extra), status_code=status, headers=headers)


def headers_for(exc: E.SessiontapeError) -> dict[str, str] | None:
    """Headers an error's answer carries: the auth challenge, or when to retry."""
    if isinstance(exc, E.Unauthenticated):
        return {"WWW-Authenticate": 'Bearer realm="sessiontape"'}
    if isinstance(exc, E.LogUnavailable | E.LogClosed | E.EngineBusy):
        return {"Retry-After": str(E.LogUnavailable.retry_after_s)}
    return None


def to_response(exc: E.SessiontapeError) -> JSONResponse:
    headers = headers_for(exc)
    fields = getattr(exc, "fields", None)
    extra = {"fields": fields} if isinstance(fields, list) else {}
    return error_response(exc.code, exc.message, status_for(exc), headers, **extra)


async def handle_core(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, E.SessiontapeError)
    return to_response(exc)


_HTTP_CODES = {
    404: "not_found",
    405: "method_not_allowed",
    400: "invalid_argument",
    401: "unauthenticated",
}


async def handle_http(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = _HTTP_CODES.get(exc.status_code, f"http_{exc.status_code}")
    return error_response(code, str(exc.detail), exc.status_code, dict(exc.headers or {}))


def internal_response(request_id: str) -> JSONResponse:
    """The only answer to an unexpected error: no exception text, no SQL, just the id to find the log line."""
    return error_response(
        "internal",
        f"internal server error (request id {request_id})",
        500,
        {"X-Request-ID": request_id},
        request_id=request_id,
    )


async def handle_unexpected(request: Request, exc: Exception) -> Response:
    rid = str(request.scope.get(REQUEST_ID) or _new_id())
    log.error("internal error in %s request_id=%s", _route(request.scope), rid, exc_info=exc)
    return internal_response(rid)


def _new_id() -> str:
    return "req_" + secrets.token_hex(8)


def _route(scope: Scope) -> str:
    """The handler's name (a closed set), never the client's path."""
    endpoint = scope.get("endpoint")
    return f"{scope.get('method', '?')} {getattr(endpoint, '__name__', 'other')}"


class LastResort:
    """Any exception a handler or middleware lets out: logged once with a request id, answered as a 500
    problem JSON without its text (or, once the response has started, the connection just ends).
    A client that went away mid-request is not an error and is not logged as one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = scope[REQUEST_ID] = _new_id()
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except (ClientDisconnect, ClientGone):
            log.debug("client went away during %s request_id=%s", _route(scope), rid)
        except Exception as exc:
            log.error("internal error in %s request_id=%s", _route(scope), rid, exc_info=exc)
            if not started:
                await internal_response(rid)(scope, receive, send)
