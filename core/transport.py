"""The Transport ABC: a wire protocol adapter that calls the runtime.

Transports live in the top-level ``transports`` package (or elsewhere) and
register under the ``sessiontape.transports`` entry-point group. ``sessiontape
serve`` builds one per enabled ``[transports.NAME]`` table, starts them all,
and stops them on SIGTERM/SIGINT. A transport declares its options as a
frozen dataclass (``options_class``, a subclass of :class:`TransportSettings`),
which the configuration validates the table with.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from sessiontape.core.settings_framework import load_section, option

if TYPE_CHECKING:
    from sessiontape.core.config import Config
    from sessiontape.core.runtime import Runtime


@dataclass(frozen=True)
class TransportSettings:
    """What every ``[transports.NAME]`` table has; a transport's own class adds its options."""

    enabled: bool = option(False, "serve this transport")
    grace_s: float = option(
        5.0, "seconds in-flight calls get to finish when the server stops", ge=0
    )


class Transport(ABC):
    """One wire protocol served by ``sessiontape serve``."""

    name: str = "?"
    #: the ``[transports.NAME]`` table's class; None: a free table, read from ``options``
    options_class: ClassVar[type[TransportSettings] | None] = None

    def __init__(
        self, runtime: Runtime, options: Mapping[str, Any] | TransportSettings, config: Config
    ) -> None:
        """``options``: the transport's settings, or its table (validated here, ConfigError)."""
        self.runtime = runtime
        self.config = config
        kind = type(self).options_class
        self.settings: Any = None
        if isinstance(options, TransportSettings):
            self.settings = options
        elif kind is not None:
            self.settings = load_section(kind, options, f"transports.{self.name}")
        self.options: dict[str, Any] = (
            dict(options) if isinstance(options, Mapping) else asdict(options)
        )

    @property
    def grace_s(self) -> float:
        """Seconds in-flight work gets to finish when ``serve`` stops (``grace_s``)."""
        if isinstance(self.settings, TransportSettings):
            return self.settings.grace_s
        return float(self.options.get("grace_s", TransportSettings.grace_s))

    @abstractmethod
    async def start(self) -> str:
        """Start serving; return one line saying where (logged by ``serve``).

        Raises :class:`sessiontape.core.errors.ConfigError` for unusable options.
        """

    @abstractmethod
    async def stop(self, grace: float = 5.0) -> None:
        """Stop accepting work; let in-flight work finish for up to ``grace`` seconds."""
