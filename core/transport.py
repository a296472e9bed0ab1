"""The Transport ABC: a wire protocol adapter that calls the runtime.

Transports live in the top-level ``transports`` package (or elsewhere) and
register under the ``sessiontape.transports`` entry-point group. ``sessiontape
serve`` builds one per enabled ``[transports.NAME]`` table, starts them all,
and stops them on SIGTERM/SIGINT.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sessiontape.core.config import Config
    from sessiontape.core.runtime import Runtime


class Transport(ABC):
    """One wire protocol served by ``sessiontape serve``."""

    name: str = "?"

    def __init__(self, runtime: Runtime, options: Mapping[str, Any], config: Config) -> None:
        self.runtime = runtime
        self.options = dict(options)
        self.config = config

    @abstractmethod
    async def start(self) -> str:
        """Start serving; return one line saying where (logged by ``serve``).

        Raises :class:`sessiontape.core.errors.ConfigError` for unusable options.
        """

    @abstractmethod
    async def stop(self, grace: float = 5.0) -> None:
        """Stop accepting work; let in-flight work finish for up to ``grace`` seconds."""
