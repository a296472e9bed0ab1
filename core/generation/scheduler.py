"""Who runs when: generations admitted a few at a time, and a priority gate around
engine steps (interactive work before batch work).

Salience's ``priority`` (0 = interactive, 10 = batch): a generation waits for
its place (:class:`Admission`) and every engine step of it passes through
:meth:`PriorityGate.slot`; when several wait, the lowest priority number goes
first, FIFO within one.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from sessiontape.core import metrics

T = TypeVar("T")

#: how long an admitted generation holds its place before the next one is let in (it
#: runs on): longer than a short turn takes, so most turns run admitted to their end,
#: short enough that a long or slowly read generation does not hold the queue
ACTIVE_HOLD_S = 0.25


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


class Admission:
    """At most ``limit`` generations run at once; the others wait their turn, in
    priority then arrival order (docs/architecture.md, "Admission").

    One event loop serves every session. With every generation running at once,
    each waits for the loop behind all the others at every step, message and
    commit, and how long a turn takes depends on how the others fell; a few
    running at a time, the rest queued in order, finish each turn in about the same
    time. A generation gives its place to the next one after ``hold_s`` (and runs
    on): a long generation, or one paced by a slow reader, does not hold the queue.
    ``limit`` 0: no limit.
    """

    def __init__(self, limit: int, hold_s: float = ACTIVE_HOLD_S) -> None:
        self.limit = limit
        self.hold_s = hold_s
        #: generations holding a place now
        self.active = 0
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._counter = itertools.count()

    def waiting(self) -> int:
        return len(self._waiters)

    def admitted(self, runs: AsyncIterator[T], priority: int = 0) -> AsyncIterator[T]:
        """``runs`` once a place is free; the place is given up when they end or after
        ``hold_s``, whichever comes first. With no limit, ``runs`` themselves."""
        if self.limit <= 0:
            return runs
        return self._admitted(runs, priority)

    async def _admitted(self, runs: AsyncIterator[T], priority: int) -> AsyncIterator[T]:
        try:
            await self._enter(priority)
        except BaseException:
            await runs.aclose()  # type: ignore[attr-defined]
            raise
        left = False

        def leave() -> None:
            nonlocal left
            if not left:
                left = True
                self._leave()

        timer = asyncio.get_running_loop().call_later(self.hold_s, leave)
        try:
            async for run in runs:
                yield run
        finally:
            timer.cancel()
            leave()
            await runs.aclose()  # type: ignore[attr-defined]

    async def _enter(self, priority: int) -> None:
        if self.active < self.limit and not self._waiters:
            self.active += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (priority, next(self._counter), fut)
        heapq.heappush(self._waiters, entry)
        metrics.GENERATIONS_WAITING.inc()
        try:
            await fut  # handed a place: ``active`` counts it already
        except BaseException:
            if fut.done() and not fut.cancelled():
                self._leave()  # handed a place but leaving
            elif entry in self._waiters:
                self._waiters.remove(entry)
                heapq.heapify(self._waiters)
            raise
        finally:
            metrics.GENERATIONS_WAITING.dec()

    def _leave(self) -> None:
        while self._waiters:
            _, _, fut = heapq.heappop(self._waiters)
            if not fut.done():
                fut.set_result(None)  # the place passes on
                return
        self.active -= 1


class _OpenGate:
    """A gate that never makes anyone wait (for engines that batch generations themselves)."""

    @asynccontextmanager
    async def slot(self, priority: int = 0) -> AsyncIterator[None]:
        yield

    def more_urgent_waiting(self, priority: int) -> bool:
        return False

    def waiting(self) -> bool:
        return False


NO_GATE: Any = _OpenGate()
