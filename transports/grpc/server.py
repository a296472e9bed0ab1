"""The gRPC server: every sessiontape service on one port, HTTP/2 in the event loop.

It hosts, on one port, every service registered under the entry-point group
``sessiontape.grpc_services`` (a :class:`sessiontape.transports.grpc.service.GrpcService`,
one instance per server), the standard health service
(``grpc.health.v1.Health``) and server reflection (``grpc.reflection.v1`` and
``v1alpha``, see :mod:`sessiontape.transports.grpc.reflection`) listing all of them.
Services register their generated handlers on a
:class:`~sessiontape.transports.grpc.calls.MethodTable` as they would on a grpc.aio
server; each handler is wrapped by :func:`sessiontape.transports.grpc.guard.guarded`.

HTTP/2 (connections, streams, flow control, HPACK) is
:mod:`sessiontape.transports.grpc.http2`; the calls on it are
:mod:`sessiontape.transports.grpc.calls`. Clients are any gRPC clients (grpcio's, grpc-js,
grpcurl): the wire is gRPC's.

Stopping: new connections and calls are refused (``UNAVAILABLE``), calls in flight
run up to the grace period, the rest are cancelled, and each service's ``drain`` is
awaited so that work cancelled at the grace deadline (a running generation) is
recorded before the runtime closes.

Options: ``[transports.grpc]``, declared by :class:`~sessiontape.transports.grpc.settings.GrpcSettings`.
When ``config.auth_token`` is set every call but health needs
``authorization: Bearer <token>``.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Any

from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from sessiontape.core import plugins
from sessiontape.core.config import parse_listen
from sessiontape.core.errors import ConfigError
from sessiontape.core.runtime import Runtime
from sessiontape.transports.grpc import calls, reflection
from sessiontape.transports.grpc.guard import guarded_methods
from sessiontape.transports.grpc.listener import Listener
from sessiontape.transports.grpc.service import GROUP, GrpcService
from sessiontape.transports.grpc.settings import GrpcSettings

log = logging.getLogger("sessiontape.grpc")

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
#: Methods answered without a token: load balancers and orchestrators probe these.
OPEN_PREFIXES = (f"/{HEALTH_SERVICE}/",)


class GrpcServer:
    """Owns the services, health and reflection, and the endpoint that serves them."""

    def __init__(
        self, runtime: Runtime, settings: GrpcSettings | None = None, auth_token: str = ""
    ) -> None:
        self.runtime = runtime
        self.settings = settings or GrpcSettings()
        self.auth_token = auth_token
        self.listen = self.settings.listen
        limits = runtime.config.limits
        self.max_message_bytes = self.settings.max_message_bytes or limits.max_body_bytes
        self.max_streams = self.settings.max_concurrent_streams or limits.max_streams_per_connection
        self.grace_s = self.settings.grace_s
        self.services: list[str] = []
        self.port: int | None = None
        self._services: list[GrpcService] = []
        self._listener: Listener | None = None
        self._closed: asyncio.Event | None = None
        self._health: HealthServicer | None = None

    def _ssl(self) -> ssl.SSLContext | None:
        cert, key = self.settings.tls_cert, self.settings.tls_key
        if cert is None or key is None:  # both or neither (GrpcSettings)
            return None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            ctx.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"transports.grpc: cannot read TLS files: {exc}") from exc
        ctx.set_alpn_protocols(["h2"])
        return ctx

    def _load_services(self, table: calls.MethodTable) -> None:
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
            service = factory.create(self.runtime, self.settings)
            self.services.extend(service.add_to(table))
            self._services.append(service)

    async def start(self) -> str:
        host, port = parse_listen(self.listen)
        context = self._ssl()
        table = calls.MethodTable()
        self._load_services(table)
        self._health = _EngineHealth(self.runtime, ("", *self.services))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, table)
        reflection.enable(table, [*self.services, HEALTH_SERVICE])
        listener = Listener(
            guarded_methods(table),
            max_message_bytes=self.max_message_bytes,
            max_streams=self.max_streams,
            token=self.auth_token,
            open_prefixes=OPEN_PREFIXES,
        )
        self.port = await listener.start(host, port, context)
        self._listener = listener
        self._closed = asyncio.Event()
        for svc in ("", *self.services):
            await self._health.set(svc, health_pb2.HealthCheckResponse.SERVING)
        scheme = "grpcs" if context is not None else "grpc"
        return (
            f"gRPC on {scheme}://{host}:{self.port} ({', '.join(self.services) or 'no services'})"
        )

    async def stop(self, grace: float | None = None) -> None:
        """Health turns NOT_SERVING; the endpoint stops (calls in flight run up to ``grace``
        s, the rest are cancelled); then each service's ``drain`` waits for the endings of
        what was cancelled to be recorded."""
        if self._listener is None:
            return
        grace = self.grace_s if grace is None else grace
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        await self._listener.stop(grace)
        for service in self._services:
            await service.drain(max(grace, 5.0))
        self._listener = None
        if self._closed is not None:
            self._closed.set()

    @property
    def methods(self) -> dict[str, calls.Method]:
        """What the endpoint answers, by path (empty before ``start``)."""
        return {} if self._listener is None else self._listener.methods

    async def wait(self) -> None:
        if self._closed is not None:
            await self._closed.wait()


class _EngineHealth(HealthServicer):  # type: ignore[misc]
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


__all__ = ["GrpcServer"]
