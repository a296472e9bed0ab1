"""``NostrTransport``: the D4 worker as a ``sessiontape serve`` transport."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sessiontape.core.transport import Transport
from sessiontape.transports.nostr.settings import NostrOptions

if TYPE_CHECKING:
    from sessiontape.core.config import Config
    from sessiontape.core.runtime import Runtime
    from sessiontape.transports.nostr.worker import D4Worker


class NostrTransport(Transport):
    name = "nostr"
    options_class = NostrOptions
    settings: NostrOptions

    def __init__(
        self, runtime: Runtime, options: Mapping[str, Any] | NostrOptions, config: Config
    ) -> None:
        super().__init__(runtime, options, config)
        self.worker: D4Worker | None = None

    async def start(self) -> str:
        from sessiontape.transports.nostr.settings import Settings
        from sessiontape.transports.nostr.worker import D4Worker

        self.worker = D4Worker(self.runtime, Settings.from_options(self.settings))
        return await self.worker.start()

    async def stop(self, grace: float = 5.0) -> None:
        if self.worker is not None:
            await self.worker.stop(grace)
            self.worker = None
