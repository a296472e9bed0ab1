"""The event loop kept polling while a gRPC message is on its way.

grpc.aio hands each message (a ``context.write``, a unary answer) to grpc's core
and wakes the event loop when the core is done with it: its poller thread writes
to a socket the loop watches. A handler awaits every write, so a Kakeya or
Salience generation's loop, with nothing else to do, went to sleep in
``epoll_wait`` once per message (21 times a served Kakeya turn, counted) and was
woken tens of microseconds later. On this project's VM a sleep and its wake-up
cost far more than the wait: two idle 100 us sleeps a turn added 0.5-0.6 ms of CPU
to a turn run in process (2026-11-28), the kernel's context switches were a fifth
of a served turn's CPU (``perf``), and caches went cold.

:class:`Spinner` keeps the loop polling instead (a callback that reschedules
itself, so each turn of the loop polls its sockets without waiting) for
``[transports.grpc] spin_s`` after a streamed message is handed over, and stops
polling once it completed. A completion that comes inside that window is taken
without a sleep; a loop with other work runs it between polls; past the window
the loop sleeps as before. A unary answer and a call's status are not waited
for this way: after them the loop would poll for the next request, which a
client sends only once it has read the answer.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any


class Spinner:
    """Keeps one event loop polling while a write it was told of is in flight, for at
    most ``spin_s`` after its start (0: never)."""

    __slots__ = ("_deadline", "_in_flight", "_loop", "_running", "spin_s")

    def __init__(self, spin_s: float) -> None:
        self.spin_s = spin_s
        self._deadline = 0.0
        self._in_flight = 0
        self._running = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def write(self, context: Any, message: Any) -> None:
        """``context.write(message)``, the loop polling until it completes (or ``spin_s``)."""
        if self.spin_s <= 0:
            await context.write(message)
            return
        self._in_flight += 1
        self._deadline = time.perf_counter() + self.spin_s
        if not self._running:
            self._running = True
            loop = self._loop = asyncio.get_running_loop()
            loop.call_soon(self._tick)
        try:
            await context.write(message)
        finally:
            self._in_flight -= 1

    def _tick(self) -> None:
        loop = self._loop
        if self._in_flight and time.perf_counter() < self._deadline and loop is not None:
            loop.call_soon(self._tick)
        else:
            self._running = False


class SpinningContext:
    """A servicer context whose ``write`` keeps the loop polling until it completes;
    everything else is the context's own."""

    __slots__ = ("_context", "_spinner")

    def __init__(self, context: Any, spinner: Spinner) -> None:
        self._context = context
        self._spinner = spinner

    def write(self, message: Any) -> Any:
        return self._spinner.write(self._context, message)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)
