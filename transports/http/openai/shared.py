"""The OpenAI-compatible routes' shared parts (``/v1/responses``, ``/v1/chat/completions``,
``/v1/models``): error shapes, request fields, the model card. The route table is
:mod:`sessiontape.transports.http.openai.routes`.

They are views of the log like every other transport: a response or a chat
completion is one generation in a session, its id names the session and the
version of its ``generation.started`` event (``resp_<session>_<version>``,
``chatcmpl-<session>_<version>``), and everything a reply shows is rebuilt
from the log, so any response can be replayed, audited and exported with
its session. docs/protocols/openai.md describes the mapping.

Errors on these routes have OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``, with the status of the
native API (:mod:`sessiontape.transports.http.server.errors`) and the core error's code.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response

from sessiontape.core import errors as E
from sessiontape.core import metrics
from sessiontape.core.errors import InvalidParameters, NotFound, SessiontapeError
from sessiontape.core.runtime import Runtime
from sessiontape.transports.http.server import errors, inputs
from sessiontape.transports.http.server.json_encoding import JSONResponse

log = logging.getLogger("sessiontape.http.openai")


class Api(Protocol):
    """What these routes use of the native API (:class:`sessiontape.transports.http.server.app.Api`)."""

    runtime: Runtime
    limits: inputs.Limits
    #: tasks that outlive their request; the API waits for them when it closes
    background: set[asyncio.Task[Any]]


#: paths whose errors (401s from the auth middleware included) take OpenAI's shape
PREFIXES = ("/v1/responses", "/v1/chat/completions", "/v1/models")

#: completion budget when a request names none
DEFAULT_MAX_TOKENS = 256


class BadParam(InvalidParameters):
    """A request field OpenAI's error names in ``param``."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFound(NotFound):
    code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model {model!r} does not exist on this server")
        self.param = "model"


def error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    return "server_error" if status >= 500 else "invalid_request_error"


def error_response(exc: SessiontapeError) -> JSONResponse:
    status = errors.status_for(exc)
    metrics.ERRORS.labels(exc.code).inc()
    body = {
        "error": {
            "message": exc.message,
            "type": error_type(status),
            "param": getattr(exc, "param", None),
            "code": exc.code,
        }
    }
    return JSONResponse(body, status_code=status, headers=errors.headers_for(exc))


def error_event(exc: BaseException) -> dict[str, Any]:
    """The body of an ``error`` event ending a stream that failed after it began."""
    if isinstance(exc, SessiontapeError):
        return {
            "message": exc.message,
            "type": error_type(errors.status_for(exc)),
            "param": None,
            "code": exc.code,
        }
    return {
        "message": "internal server error",
        "type": "server_error",
        "param": None,
        "code": "internal",
    }


Handler = Callable[[Request], Awaitable[Response]]


def openai_errors(fn: Handler) -> Handler:
    """Core errors (and anything unexpected) become OpenAI-shaped error responses."""

    @functools.wraps(fn)
    async def wrapper(request: Request) -> Response:
        try:
            return await fn(request)
        except SessiontapeError as exc:
            return error_response(exc)
        except Exception:
            log.exception("unhandled error on %s", request.url.path)
            return error_response(E.SessiontapeError("internal server error"))

    return wrapper


# -- request fields ------------------------------------------------------------


async def json_body(request: Request, limits: inputs.Limits) -> dict[str, Any]:
    """The JSON object body, read within the native API's size, time and depth limits (its fields
    are its model's to check: :mod:`sessiontape.transports.http.openai.bodies`)."""
    value = await inputs.body(request, limits)
    if not value:
        raise E.InvalidArgument("request body must be a non-empty JSON object")
    return value


def split_id(value: str, prefix: str) -> tuple[str, int]:
    """``<prefix><session id>_<version>`` to (session id, version); NotFound otherwise."""
    body = value[len(prefix) :] if value.startswith(prefix) else ""
    sid, _, version = body.rpartition("_")
    if not sid or not version.isdigit() or len(version) > 12:
        raise NotFound(f"no response with id {value!r}")
    return sid, int(version)


# -- models ----------------------------------------------------------------------


class Models:
    def __init__(self, api: Api) -> None:
        self.runtime = api.runtime

    @property
    def model_id(self) -> str:
        return self.runtime.engine.info.model_id

    def check(self, b: Mapping[str, Any]) -> str:
        """The request's ``model``: the served model's id, or its engine's name as an alias."""
        model = b.get("model")
        if not isinstance(model, str) or not model:
            raise BadParam("model", "model is required (GET /v1/models lists the served model)")
        info = self.runtime.engine.info
        if model not in (info.model_id, info.name):
            raise ModelNotFound(model)
        return info.model_id

    def card(self) -> dict[str, Any]:
        info = self.runtime.engine.info
        return {
            "id": info.model_id,
            "object": "model",
            "created": 0,
            "owned_by": "sessiontape",
            "engine": info.name,
            "provider": info.provider,
            "max_length": info.max_length,
            "model_hash": info.model_hash,
            # what a request that names no temperature / top_p / top_k gets (docs/models.md)
            "sampling": info.sampling.to_json(),
        }

    async def list(self, _: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self.card()]})

    async def get(self, request: Request) -> Response:
        model = request.path_params["model"]
        info = self.runtime.engine.info
        if model not in (info.model_id, info.name):
            raise ModelNotFound(model)
        return JSONResponse(self.card())
