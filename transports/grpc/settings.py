"""The gRPC transport's options (``[transports.grpc]``), for the server and the services on it."""

from __future__ import annotations

from dataclasses import dataclass

from sessiontape.core.config import host_port
from sessiontape.core.errors import ConfigError
from sessiontape.core.settings_framework import option
from sessiontape.core.transport import TransportSettings


@dataclass(frozen=True)
class GrpcSettings(TransportSettings):
    """``[transports.grpc]``: Evergreen, Salience and Kakeya, health and reflection on one port."""

    enabled: bool = option(True, "serve this transport")
    listen: str = option(
        "127.0.0.1:50051", "HOST:PORT to serve on (port 0: any free one)", check=host_port
    )
    tls_cert: str | None = option(None, "PEM certificate file (with `tls_key`; both or neither)")
    tls_key: str | None = option(None, "PEM private key file", repr=False)
    max_message_bytes: int = option(
        4 << 20,
        "receive and send limit per message, a compressed one counted as it inflates",
        ge=1,
    )
    max_concurrent_streams: int | None = option(
        None,
        "streams one client connection may open",
        ge=1,
        shown="`[limits] max_streams_per_connection`",
    )
    sink: int | None = option(
        None,
        "Kakeya truncation: first positions kept (docs/protocols/kakeya.md)",
        ge=0,
        shown="`[sessions] kakeya_sink`",
    )
    window: int | None = option(
        None,
        "Kakeya truncation: last positions kept; unset: no truncation",
        ge=1,
        shown="`[sessions] kakeya_window`",
    )

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("transports.grpc: set both tls_cert and tls_key, or neither")
