"""The D4 worker's relay I/O on nostr-sdk: connect, subscribe, read, publish, watch reconnects.

Nothing here knows about calls: the worker says what to subscribe to
(``filters(since)``), what to do with an event (``on_event``) and after a
reconnect (``on_reconnect``).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import nostr_sdk as ns

from sessiontape.core.errors import ConfigError
from sessiontape.transports.nostr.settings import Settings

log = logging.getLogger("sessiontape.nostr")

SUBSCRIPTION = "d4-calls"

#: ``since`` -> the filters to (re-)subscribe with
Filters = Callable[[int], list[Any]]


class Relays:
    """The worker's relay pools: ``client`` reads (the calls subscription), ``publisher``
    publishes; both None once closed.

    Two connections to each relay, because a D4 result carries the function's ``e``
    tag that the calls subscription filters on (NIP-01 filters cannot exclude an
    author): on one connection a relay writes each published result back to the
    worker and then its ``OK``, two small writes, and a relay socket with Nagle's
    algorithm on (nostr-sdk's own relay, for one) holds the ``OK`` until the worker
    acknowledges the echo, which Linux delays up to 40 ms, so every other partial
    result would wait that long for its ``OK``. The publishing connection subscribes to nothing, so each
    publish gets its ``OK`` as one write.
    """

    def __init__(self, settings: Settings, stats: Counter[str]) -> None:
        self.settings = settings
        self.stats = stats
        self.client: Any = None
        self.publisher: Any = None

    async def connect(self) -> None:
        # nostr-sdk runs Python callbacks (policies, monitors) on this loop
        ns.uniffi_set_event_loop(asyncio.get_running_loop())
        opts = (
            ns.RelayOptions()
            .reconnect(True)
            .retry_interval(datetime.timedelta(seconds=self.settings.reconnect_min_s))
            .adjust_retry_interval(True)
        )
        urls = []
        for url in self.settings.relays:
            try:
                urls.append(ns.RelayUrl.parse(url))
            except Exception as exc:
                raise ConfigError(f"transports.nostr.relays: bad relay URL {url!r}") from exc
        client, publisher = ns.ClientBuilder().build(), ns.ClientBuilder().build()
        for pool in (client, publisher):
            for relay_url in urls:
                await pool.add_relay(relay_url, opts=opts)
        self.client, self.publisher = client, publisher
        timeout = datetime.timedelta(seconds=self.settings.connect_timeout_s)
        await asyncio.gather(client.connect(timeout), publisher.connect(timeout))

    async def subscribe(self, filters: list[Any]) -> Any:
        """Subscribe on every relay; returns the notification stream to :meth:`read`."""
        notes = self.client.notifications()
        await self.client.subscribe(ns.ReqTarget.auto(filters), SUBSCRIPTION)
        return notes

    async def read(self, notes: Any, on_event: Callable[[Any], object]) -> None:
        """Hand every new event to ``on_event`` until the client shuts down."""
        while True:
            note = await notes.next()
            if note.is_shutdown():
                return
            if note.is_new_event():
                on_event(note.event)

    async def watch(
        self,
        filters: Filters,
        since: Callable[[], int],
        on_reconnect: Callable[[], None],
        on_tick: Callable[[], None],
    ) -> None:
        """Re-subscribe on a relay that came back, with ``since()`` (from the log).

        nostr-sdk reconnects by itself (retry interval adjusted with back-off);
        this refreshes the subscription so an outage's calls are fetched.
        ``on_tick`` runs every quarter second.
        """
        was: dict[str, bool] = {}
        first = True
        while True:
            if not first:
                await asyncio.sleep(0.25)
            first = False
            on_tick()
            try:
                relays = await self.client.relays()
            except Exception as exc:
                log.debug("listing relays failed: %s", exc)
                continue
            for url, relay in relays.items():
                key = str(url)
                up = relay.status() == ns.RelayStatus.CONNECTED
                if was.get(key) is False and up:
                    at = since()
                    try:
                        target = ns.ReqTarget.manual({url: filters(at)})
                        await self.client.subscribe(target, SUBSCRIPTION)
                        log.info("relay %s reconnected; re-subscribed since %d", key, at)
                        self.stats["resubscribed"] += 1
                        on_reconnect()
                    except Exception as exc:
                        log.warning("relay %s: re-subscribe failed: %s", key, exc)
                        continue
                elif was.get(key) and not up:
                    self.stats["disconnects"] += 1
                    log.warning("relay %s disconnected (%s); reconnecting", key, relay.status())
                was[key] = up

    async def unsubscribe(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.unsubscribe_all()

    async def close(self) -> None:
        for pool in (self.client, self.publisher):
            if pool is not None:
                with contextlib.suppress(Exception):
                    await pool.shutdown()
        self.client = self.publisher = None

    async def publish(self, event: Any) -> list[str]:
        """Send to every relay; retry the ones that reject (rate limits) with back-off.

        Returns the relays that took the event (``duplicate:`` answers
        included: they already have it), sorted; empty when none did.
        """
        target: Any = None
        eid = event.id().to_hex()
        accepted: set[str] = set()
        failed: dict[str, str] = {}
        for attempt in range(self.settings.publish_retries + 1):
            try:
                if self.publisher is None:
                    raise ConnectionError("the worker is stopped")
                if target is None:
                    out = await self.publisher.send_event(event)
                else:
                    out = await self.publisher.send_event(event, ns.SendEventTarget.to(target))
                accepted |= {str(u) for u in out.success}
                accepted |= {
                    str(u) for u, m in out.failed.items() if str(m).startswith("duplicate")
                }
                failed = {
                    str(u): str(m)
                    for u, m in out.failed.items()
                    if not str(m).startswith("duplicate")
                }
            except Exception as exc:  # the SDK raises when no relay took it
                failed = {
                    url: str(exc)
                    for url in (self.settings.relays if target is None else map(str, target))
                }
            if not failed:
                return sorted(accepted)
            self.stats["publish_failures"] += len(failed)
            for url, msg in failed.items():
                log.warning(
                    "relay %s rejected %s (attempt %d): %s", url, eid[:12], attempt + 1, msg
                )
            if attempt == self.settings.publish_retries or self.publisher is None:
                break
            target = [ns.RelayUrl.parse(u) for u in failed]
            await asyncio.sleep(min(self.settings.retry_base_s * (2**attempt), 5.0))
        log.error("gave up publishing %s to %s", eid[:12], ", ".join(failed))
        return sorted(accepted)
