"""A priority gate around engine steps: interactive work before batch work.

Salience's ``priority`` (0 = interactive, 10 = batch): every engine step of a
generation passes through :meth:`PriorityGate.slot`; when several
generations wait, the lowest priority number goes first, FIFO within one.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class PriorityGate:
    def __init__(self) -> None:
        self._busy = False
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._counter = itertools.count()

    @asynccontextmanager
    async def slot(self, priority: int = 0) -> AsyncIterator[None]:
        if self._busy or self._waiters:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            entry = (priority, next(self._counter), fut)
            heapq.heappush(self._waiters, entry)
            try:
                await fut
            except BaseException:
                if fut.done() and not fut.cancelled():
                    self._release()  # we were handed the slot but are leaving
                elif entry in self._waiters:
                    self._waiters.remove(entry)
                    heapq.heapify(self._waiters)
                raise
        else:
            self._busy = True
        try:
            yield
        finally:
            self._release()

    def more_urgent_waiting(self, priority: int) -> bool:
        """Whether a waiter with a lower priority number than ``priority`` is queued
        (a holder running a burst of steps should hand over)."""
        return bool(self._waiters) and self._waiters[0][0] < priority

    def waiting(self) -> bool:
        return bool(self._waiters)

    def _release(self) -> None:
        while self._waiters:
            _, _, fut = heapq.heappop(self._waiters)
            if not fut.done():
                fut.set_result(None)  # hand over: stays busy
                return
        self._busy = False
