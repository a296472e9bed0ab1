"""The ``grpc`` entry point of ``sessiontape.transports``: see :mod:`sessiontape.transports.grpc.server`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sessiontape.core.transport import Transport
from sessiontape.transports.grpc.settings import GrpcSettings

if TYPE_CHECKING:
    from sessiontape.core.config import Config
    from sessiontape.core.runtime import Runtime
    from sessiontape.transports.grpc.server import GrpcServer


class GrpcTransport(Transport):
    """Evergreen, Salience and Kakeya (whichever are installed) on one gRPC port."""

    name = "grpc"
    options_class = GrpcSettings
    settings: GrpcSettings

    def __init__(
        self, runtime: Runtime, options: Mapping[str, Any] | GrpcSettings, config: Config
    ) -> None:
        super().__init__(runtime, options, config)
        self.server: GrpcServer | None = None

    async def start(self) -> str:
        # grpc is heavy: import it only when the transport is actually enabled.
        from sessiontape.transports.grpc.server import GrpcServer

        self.server = GrpcServer(self.runtime, self.settings, self.config.auth_token)
        return await self.server.start()

    async def stop(self, grace: float = 5.0) -> None:
        if self.server is not None:
            await self.server.stop(grace)

    @property
    def port(self) -> int | None:
        return None if self.server is None else self.server.port
