"""The gRPC server: one ``grpc.aio`` server for every sessiontape service.

It hosts, on one port, every service registered under the entry-point group
``sessiontape.grpc_services`` (a :class:`sessiontape.transports.grpc.service.GrpcService`,
one instance per server), the standard health service
(``grpc.health.v1.Health``) and server reflection (``grpc.reflection.v1`` and
``v1alpha``, see :mod:`sessiontape.transports.grpc.reflection`) listing all of them. After
the server stopped, each service's ``drain`` is awaited so that work cancelled
at the grace deadline (a running generation) is recorded before the runtime
closes.

Options: ``[transports.grpc]``, declared by :class:`~sessiontape.transports.grpc.settings.GrpcSettings`.
Every handler is wrapped by :class:`sessiontape.transports.grpc.guard.GuardInterceptor`. When ``config.auth_token`` is set
every call but health needs ``authorization: Bearer <token>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from sessiontape.core import plugins
from sessiontape.core.config import parse_listen
from sessiontape.core.errors import ConfigError, Unauthenticated
from sessiontape.core.runtime import Runtime
from sessiontape.transports.grpc import reflection
from sessiontape.transports.grpc.guard import GuardInterceptor
from sessiontape.transports.grpc.service import GROUP, GrpcService
from sessiontape.transports.grpc.settings import GrpcSettings
from sessiontape.transports.grpc.status import code_for, message_for

log = logging.getLogger("sessiontape.grpc")

#: A connection that has not sent its HTTP/2 preface within this time is closed (grpcio's
#: default is 120 s): a real client sends it at once, a silent one only holds a socket.
HANDSHAKE_TIMEOUT_MS = 10_000

#: Tries, 0.1 s apart, to listen again after the server died (its socket may take a
#: moment to close on a loaded machine).
RESTART_ATTEMPTS = 200

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
#: Methods answered without a token: load balancers and orchestrators probe these.
OPEN_PREFIXES = (f"/{HEALTH_SERVICE}/",)


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Requires ``authorization: Bearer <token>`` on every call outside OPEN_PREFIXES."""

    def __init__(self, token: str) -> None:
        self._expected = token.encode()

    def _authorized(self, metadata: Any) -> bool:
        for key, value in metadata or ():
            if key.lower() == "authorization":
                got = value.encode(errors="replace") if isinstance(value, str) else bytes(value)
                # the scheme is case-insensitive (RFC 9110 section 11.1); the token is not
                scheme, _, token = got.strip().partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(
                    token.strip(), self._expected
                )
        return False

    async def intercept_service(
        self,
        continuation: Callable[[Any], Awaitable[Any]],
        details: Any,
    ) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIXES):
            return handler
        if self._authorized(details.invocation_metadata):
            return handler
        return _rejecting(
            handler,
            Unauthenticated(
                "missing or wrong bearer token (metadata 'authorization: Bearer <token>')"
            ),
        )


def _rejecting(handler: Any, exc: Exception) -> Any:
    """A handler of the same shape as ``handler`` that ends the call with ``exc``'s status."""
    code, message = code_for(exc), message_for(exc)

    async def unary(request: Any, context: Any) -> Any:
        await context.abort(code, message)

    async def streaming(request: Any, context: Any) -> Any:
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(bool(handler.request_streaming), bool(handler.response_streaming))]
    return make(
        streaming if handler.response_streaming else unary,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class GrpcServer:
    """Owns the ``grpc.aio.Server`` and the services it hosts, and keeps it serving.

    grpcio 1.85's aio server stops listening when a request's ``:path`` is not UTF-8:
    the Cython server loop raises ``UnicodeDecodeError`` before any handler or
    interceptor sees the call, and the process lives on with no gRPC port. No public
    option prevents it, so a supervisor task awaits the server's termination; when it
    ends without :meth:`stop` having been called, it logs an ERROR and serves again on
    the same address with the same services (calls in flight on the dead server end)."""

    def __init__(
        self, runtime: Runtime, settings: GrpcSettings | None = None, auth_token: str = ""
    ) -> None:
        self.runtime = runtime
        self.settings = settings or GrpcSettings()
        self.auth_token = auth_token
        self.listen = self.settings.listen
        limits = runtime.config.limits
        self.max_message_bytes = self.settings.max_message_bytes
        self.max_streams = self.settings.max_concurrent_streams or limits.max_streams_per_connection
        self.grace_s = self.settings.grace_s
        self.services: list[str] = []
        self.port: int | None = None
        #: how many times the supervisor served again after the server died
        self.restarts = 0
        self._services: list[GrpcService] = []
        self._server: Any = None
        self._health: _EngineHealth | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._stopping = False

    def _credentials(self) -> Any:
        cert, key = self.settings.tls_cert, self.settings.tls_key
        if cert is None or key is None:  # both or neither (GrpcSettings)
            return None
        try:
            pair = (Path(key).read_bytes(), Path(cert).read_bytes())
        except OSError as exc:
            raise ConfigError(f"transports.grpc: cannot read TLS files: {exc}") from exc
        return grpc.ssl_server_credentials([pair])

    def _load_services(self) -> None:
        names = plugins.available(GROUP)
        if not names:
            raise ConfigError(
                f"transports.grpc: no services registered under {GROUP!r}"
                " (is the package installed? pip install -e .)"
            )
        for name in names:
            factory = plugins.load(GROUP, name)
            if not (isinstance(factory, type) and issubclass(factory, GrpcService)):
                raise ConfigError(f"transports.grpc: service {name!r} is not a GrpcService")
            self._services.append(factory.create(self.runtime, self.settings))

    def _build(self, address: str, creds: Any) -> tuple[Any, int]:
        """A new grpc.aio server with every service, health and reflection, bound to
        ``address``; returns it and the port it got."""
        interceptors: list[Any] = [GuardInterceptor()]
        if self.auth_token:
            interceptors.append(BearerAuthInterceptor(self.auth_token))
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.max_send_message_length", self.max_message_bytes),
                ("grpc.max_concurrent_streams", self.max_streams),
                ("grpc.so_reuseport", 0),
                ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
            ],
        )
        names: list[str] = []
        for service in self._services:
            names.extend(service.add_to(server))
        self.services = names
        if self._health is None:
            self._health = _EngineHealth(self.runtime, ("", *names))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable(server, [*names, HEALTH_SERVICE])
        try:
            bound = (
                server.add_secure_port(address, creds)
                if creds is not None
                else server.add_insecure_port(address)
            )
        except RuntimeError as exc:
            raise ConfigError(f"transports.grpc: cannot listen on {address}: {exc}") from exc
        if not bound:
            raise ConfigError(f"transports.grpc: cannot listen on {address}")
        return server, int(bound)

    async def start(self) -> str:
        host, port = parse_listen(self.listen)
        creds = self._credentials()
        self._load_services()
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        server, self.port = self._build(address, creds)
        await server.start()
        self._server = server
        assert self._health is not None
        for svc in ("", *self.services):
            await self._health.set(svc, health_pb2.HealthCheckResponse.SERVING)
        # the same port again after a restart, even when the config said "any free one"
        again = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"
        self._supervisor = asyncio.create_task(self._supervise(again, creds))
        scheme = "grpcs" if creds is not None else "grpc"
        return (
            f"gRPC on {scheme}://{host}:{self.port} ({', '.join(self.services) or 'no services'})"
        )

    async def _supervise(self, address: str, creds: Any) -> None:
        while not self._stopping:
            server = self._server
            try:
                await server.wait_for_termination()
                why = "it terminated"
            except Exception as exc:  # the server loop's own failure (see the class doc)
                why = f"{type(exc).__name__}: {str(exc)[:200]}"
            if self._stopping or server is not self._server:
                return
            log.error("gRPC server stopped serving (%s); serving again on %s", why, address)
            with contextlib.suppress(Exception):
                await server.stop(0)
            for attempt in range(RESTART_ATTEMPTS):
                try:
                    fresh, _ = self._build(address, creds)
                    await fresh.start()
                except ConfigError:
                    if attempt == RESTART_ATTEMPTS - 1:
                        log.error("gRPC server could not listen again on %s", address)
                        raise
                    await asyncio.sleep(0.1)  # the dead server's socket is still closing
                    continue
                break
            self._server = fresh
            self.restarts += 1

    async def stop(self, grace: float | None = None) -> None:
        """Refuse new calls, let in-flight ones run up to ``grace`` s, then cancel the rest."""
        if self._server is None:
            return
        self._stopping = True
        grace = self.grace_s if grace is None else grace
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        await self._server.stop(grace)
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
        for service in self._services:
            await service.drain(max(grace, 5.0))
        self._server = None

    async def wait(self) -> None:
        while self._server is not None and not self._stopping:
            supervisor = self._supervisor
            if supervisor is None:
                return
            await asyncio.shield(supervisor)


class _EngineHealth(health_aio.HealthServicer):  # type: ignore[misc]
    """The standard health service, NOT_SERVING for every service once the engine can
    serve nothing more (``Engine.failure``: an engine worker that died), as HTTP's
    ``/healthz`` answers 503. Checked on each Check; Watch streams hear of it then."""

    def __init__(self, runtime: Runtime, services: tuple[str, ...]) -> None:
        super().__init__()
        self._runtime = runtime
        self._services = services
        self._down = False

    async def Check(self, request: Any, context: Any) -> Any:
        if not self._down and self._runtime.engine.failure() is not None:
            self._down = True
            for svc in self._services:
                await self.set(svc, health_pb2.HealthCheckResponse.NOT_SERVING)
        return await super().Check(request, context)


__all__ = ["BearerAuthInterceptor", "GrpcServer"]
