"""What a service on the gRPC server is, and where the server finds them.

Services register under the entry-point group ``sessiontape.grpc_services``
(pyproject.toml), like engines and transports, so that list is the only one:
the server loads each by name through :mod:`sessiontape.core.plugins`, and a third
party adds a service by publishing an entry point.

A service is an object the server creates per server instance: whatever it
tracks (open streams, running generations) belongs to that server, not to
the module, so two servers in one process never see each other's calls.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from sessiontape.core.runtime import Runtime
from sessiontape.transports.grpc.settings import GrpcSettings

GROUP = "sessiontape.grpc_services"


class GrpcService(ABC):
    """One gRPC service hosted by :class:`sessiontape.transports.grpc.server.GrpcServer`."""

    @classmethod
    @abstractmethod
    def create(cls, runtime: Runtime, settings: GrpcSettings) -> GrpcService:
        """A new instance for one server, with the server's ``[transports.grpc]`` settings;
        raises ConfigError where they do not fit the service."""

    @abstractmethod
    def add_to(self, server: Any) -> list[str]:
        """Register on a ``grpc.aio`` server; returns the full service names added."""

    async def drain(self, limit_s: float) -> None:  # noqa: B027 - most services have nothing to drain
        """After the server stopped: wait up to ``limit_s`` for the calls cancelled at the grace
        deadline (a running generation) to record their end."""
