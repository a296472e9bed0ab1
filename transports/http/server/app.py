"""The HTTP server's app: the native and OpenAI-compatible routes, the viewer, the service
routes (``/healthz``, ``/metrics``, ``/openapi.json``) and the middleware around them.

From the outside in: the access log, the drain that ends open requests when the server
stops, the last-resort 500, the per-client bound, the bearer token.
"""

from __future__ import annotations

import contextlib
import hmac
from collections.abc import AsyncIterator

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from sessiontape.core.errors import SessiontapeError, Unauthenticated
from sessiontape.core.runtime import Runtime
from sessiontape.transports.http import viewer
from sessiontape.transports.http.native.routes import Api
from sessiontape.transports.http.native.routes import routes as native_routes
from sessiontape.transports.http.openai.routes import routes as openai_routes
from sessiontape.transports.http.openai.shared import PREFIXES as OPENAI_PREFIXES
from sessiontape.transports.http.openai.shared import error_response as openai_error
from sessiontape.transports.http.server import errors, inputs
from sessiontape.transports.http.server.accesslog import AccessLog
from sessiontape.transports.http.server.drain import Drain, Inflight
from sessiontape.transports.http.server.json_encoding import JSONResponse
from sessiontape.transports.http.server.limits import HeadLimit, PerClientLimit
from sessiontape.transports.http.server.openapi import spec


class Service:
    """The routes that describe the server rather than sessions: health, metrics, OpenAPI."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    async def healthz(self, _: Request) -> Response:
        engine = self.runtime.engine
        failure = engine.failure()
        if failure is not None:  # the engine can serve nothing more: restart the server
            return JSONResponse(
                {"status": "unavailable", "engine": engine.info.name, "error": failure},
                status_code=503,
            )
        return JSONResponse({"status": "ok", "engine": engine.info.name})

    async def metrics(self, _: Request) -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    async def openapi(self, _: Request) -> Response:
        return JSONResponse(spec())


class BearerAuth:
    """401 with a JSON error unless the request carries the configured bearer token.

    EventSource cannot set headers, so ``?access_token=`` is accepted too.
    Health, metrics, the OpenAPI description and the viewer's static files are open.
    """

    OPEN = ("/healthz", "/metrics", "/openapi.json", "/static/")

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.token = token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.token:
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path == "/" or path.startswith(self.OPEN):
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        auth = request.headers.get("authorization", "")
        given = (
            auth[7:].strip()
            if auth.lower().startswith("bearer ")
            else request.query_params.get("access_token", "")
        )
        if not hmac.compare_digest(given.encode(), self.token):
            exc = Unauthenticated("missing or wrong bearer token")
            shape = openai_error if path.startswith(OPENAI_PREFIXES) else errors.to_response
            await shape(exc)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def create_app(
    runtime: Runtime,
    *,
    auth_token: str = "",
    heartbeat_s: float = 15.0,
    ring: int = 4096,
    ring_bytes: int = 65536,
    linger_s: float = 30.0,
    limits: inputs.Limits | None = None,
) -> Starlette:
    api = Api(
        runtime,
        heartbeat_s=heartbeat_s,
        ring=ring,
        ring_bytes=ring_bytes,
        linger_s=linger_s,
        limits=limits,
    )
    service = Service(runtime)
    routes = [
        Route("/healthz", service.healthz),
        Route("/metrics", service.metrics),
        Route("/openapi.json", service.openapi),
        *native_routes(api),
        *openai_routes(api),
        *viewer.routes(),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        yield
        await api.aclose()

    app = Starlette(
        routes=routes,
        exception_handlers={
            SessiontapeError: errors.handle_core,
            HTTPException: errors.handle_http,
        },
        lifespan=lifespan,
    )
    app.state.api = api
    if auth_token:
        app.add_middleware(BearerAuth, token=auth_token)
    app.add_middleware(PerClientLimit, max_requests=api.limits.max_requests_per_client)
    app.add_middleware(HeadLimit, max_header_bytes=api.limits.max_header_bytes)
    # outermost of ours: whatever escapes a handler or the auth check is one logged 500 without its text
    app.add_middleware(errors.LastResort)
    # requests in flight, ended quietly when the server stops (HttpTransport.stop)
    app.state.inflight = Inflight()
    app.add_middleware(Drain, inflight=app.state.inflight)
    # outermost: one access-log record per request, with the request id LastResort assigned
    app.add_middleware(AccessLog)
    return app
