"""The client's errors: one root, a class per HTTP status family, a class per common code.

::

    ClientError
    ├── TransportError        the server could not be reached, or a stream broke past its retries
    └── APIError              the server answered ``{"error": {"code", "message"}}`` (status, code, message, body)
        ├── BadRequest          400 (invalid_parameters, invalid_argument, unknown fields, ...)
        ├── Unauthenticated     401
        ├── NotFound            404
        │   └── SessionNotFound   session_not_found, session_expired
        ├── Conflict            409
        │   ├── SessionBusy       session_busy (one writer per session)
        │   ├── SessionClosed     session_closed
        │   └── OffsetMismatch    offset_mismatch (Salience drift check)
        ├── PayloadTooLarge     413 (context_overflow, payload_too_large)
        ├── RateLimited         429
        └── ServerError         5xx

:func:`from_response` is the one place a status and body become an exception;
the codes are those of docs/protocols/http.md.
"""

from __future__ import annotations

import json
from typing import Any


class ClientError(Exception):
    """Root of everything :mod:`sessiontape.client` raises on purpose."""


class TransportError(ClientError):
    """No answer: connection refused or reset, a timeout, a stream cut past its retries."""


class APIError(ClientError):
    """The server refused the request; ``code`` is its stable machine-readable name."""

    def __init__(self, status: int, code: str, message: str, body: Any = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.body = body


class BadRequest(APIError):
    pass


class Unauthenticated(APIError):
    pass


class NotFound(APIError):
    pass


class SessionNotFound(NotFound):
    pass


class Conflict(APIError):
    pass


class SessionBusy(Conflict):
    pass


class SessionClosed(Conflict):
    pass


class OffsetMismatch(Conflict):
    pass


class PayloadTooLarge(APIError):
    pass


class RateLimited(APIError):
    pass


class ServerError(APIError):
    pass


BY_CODE: dict[str, type[APIError]] = {
    "session_not_found": SessionNotFound,
    "session_expired": SessionNotFound,
    "session_busy": SessionBusy,
    "session_closed": SessionClosed,
    "offset_mismatch": OffsetMismatch,
}

BY_STATUS: dict[int, type[APIError]] = {
    400: BadRequest,
    401: Unauthenticated,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
    429: RateLimited,
}


def error_class(status: int, code: str) -> type[APIError]:
    cls = BY_CODE.get(code)
    if cls is not None:
        return cls
    if status >= 500:
        return ServerError
    return BY_STATUS.get(status, APIError)


def from_body(status: int, response: Any) -> APIError:
    """The exception for an error response body (``{"error": {"code", "message"}}``, or anything else)."""
    err = response.get("error") if isinstance(response, dict) else None
    if isinstance(err, dict):
        code = str(err.get("code") or f"http_{status}")
        message = str(err.get("message") or "")
    else:
        code, message = f"http_{status}", str(response)[:500]
    return error_class(status, code)(status, code, message, response)


def from_response(status: int, content: bytes) -> APIError:
    try:
        body: Any = json.loads(content) if content else None
    except ValueError:
        body = content.decode("utf-8", "replace")
    return from_body(status, body)
