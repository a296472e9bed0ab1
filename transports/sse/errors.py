"""The one mapping from core errors to HTTP: status code + ``{"error": {"code", "message"}}``.

The most specific class listed wins (the exception's MRO is walked), so a
new core error inherits its family's status until it is listed here.
"""

from __future__ import annotations

import logging

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from core import errors as E
from core import metrics

log = logging.getLogger("sessiontape.http")

STATUS: dict[type[E.SessiontapeError], int] = {
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
    E.ConfigError: 500,
    E.EngineError: 502,
    E.SessiontapeError: 500,
}


def status_for(exc: E.SessiontapeError) -> int:
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 500


def error_body(code: str, message: str) -> dict[str, dict[str, str]]:
    return {"error": {"code": code, "message": message}}


def error_response(code: str, message: str, status: int, headers: dict[str, str] | None = None) -> JSONResponse:
    metrics.ERRORS.labels(code).inc()
    return JSONResponse(error_body(code, message), status_code=status, headers=headers)


def to_response(exc: E.SessiontapeError) -> JSONResponse:
    headers = {"WWW-Authenticate": 'Bearer realm="sessiontape"'} if isinstance(exc, E.Unauthenticated) else None
    return error_response(exc.code, exc.message, status_for(exc), headers)


async def handle_core(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, E.SessiontapeError)
    return to_response(exc)


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 400: "invalid_argument", 401: "unauthenticated"}


async def handle_http(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = _HTTP_CODES.get(exc.status_code, f"http_{exc.status_code}")
    return error_response(code, str(exc.detail), exc.status_code, dict(exc.headers or {}))


async def handle_unexpected(_: Request, exc: Exception) -> Response:
    log.exception("unhandled error", exc_info=exc)
    return error_response("internal", "internal server error", 500)
