"""Subscriptions: committed events to every reader, catch-up from the database then live.

In a process that is the only writer (SQLite), events are handed to live
subscribers straight from the writer after COMMIT. When other processes write
too (PostgreSQL replicas, or a read-only follower such as ``replay
--follow``), a tailer task reads everything committed after the last
position it published, in position order, woken by the dialect's hint
(LISTEN/NOTIFY) or by polling; positions are assigned under a lock held to
COMMIT, so a tailer never skips an event that commits late.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from sessiontape.core import metrics
from sessiontape.core.bodies import fork_point
from sessiontape.core.events import Event, T

log = logging.getLogger("sessiontape.log")

#: reads committed events after a position: ``(after, limit, session_id) -> events``
Reader = Callable[[int, int, "str | None"], Awaitable[list[Event]]]

PAGE = 1000


class _Subscriber:
    #: live events a subscriber may fall behind by; past that it catches up from the database
    QUEUE_MAX = 10_000

    def __init__(self, session_id: str | None, with_forks: bool = False) -> None:
        self.session_id = session_id
        self.with_forks = with_forks
        #: what each commit handed over that this subscriber wants, a list per commit
        self.queue: asyncio.Queue[list[Event]] = asyncio.Queue()
        #: events in ``queue``
        self.pending = 0
        self.overflowed = False

    def wants(self, e: Event) -> bool:
        sid = self.session_id
        if sid is None or e.session_id == sid:
            return True
        if not self.with_forks:
            return False
        parent = fork_point(e)
        return parent is not None and parent.get("session_id") == sid

    def offer(self, evs: list[Event]) -> None:
        """A commit's events (in position order): the wanted ones, queued as one item
        (one queue hop and one wake-up per commit, not per event)."""
        sid = self.session_id
        if sid is None:
            wanted = evs[:]  # its own list: a reader may keep or change what it is given
        elif self.with_forks:
            wanted = [e for e in evs if self.wants(e)]
        else:
            wanted = [e for e in evs if e.session_id == sid]
        if not wanted:
            return
        if self.pending + len(wanted) > self.QUEUE_MAX:
            self.overflowed = True
            return
        self.pending += len(wanted)
        self.queue.put_nowait(wanted)

    def take(self, item: list[Event]) -> list[Event]:
        self.pending -= len(item)
        return item


class Subscriptions:
    def __init__(self, read: Reader, *, tail: bool, poll_interval_s: float) -> None:
        self._read = read
        #: read other processes' commits from the database (instead of only our own, handed over)
        self.tail = tail
        self.poll_interval_s = poll_interval_s
        self._subscribers: set[_Subscriber] = set()
        #: the same subscribers, found without looking at the others: those of every
        #: event, those of one session, those of a session's forks' ``session.opened``
        self._of_all: set[_Subscriber] = set()
        self._of_session: dict[str, set[_Subscriber]] = {}
        self._of_forks: dict[str, set[_Subscriber]] = {}
        self._published = 0
        #: the log's end after this process's commit in flight: its NOTIFY (which may
        #: arrive before the commit's answer) is this process's own, not a reason to read
        self._own_end = 0
        self._wake = asyncio.Event()
        self._tailer: asyncio.Task[None] | None = None
        self._closing = False

    @property
    def published(self) -> int:
        """The last position handed to subscribers (or, with none, skipped past)."""
        return self._published

    def start(self, last_position: int) -> None:
        self._closing = False
        self._published = last_position
        if self.tail:
            self._tailer = asyncio.create_task(self._tail_loop(), name="sessiontape-log-tailer")

    def wake(self, end: int | None = None) -> None:
        """A hint that a process committed (LISTEN/NOTIFY), with the log's end after it
        when known: this process's own commits, published already, wake nobody."""
        if end is not None and end <= max(self._published, self._own_end):
            return
        self._wake.set()

    async def close(self) -> None:
        self._closing = True  # the tailer stops at its next wake even if a cancel were lost
        if self._tailer is not None:
            self._tailer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._tailer
            self._tailer = None

    def expect(self, end: int) -> None:
        """This process's writer is about to commit up to ``end`` and will hand the
        events on (:meth:`committed`); a commit that fails sends no NOTIFY, and one
        planned again commits as usual."""
        self._own_end = max(self._own_end, end)

    def committed(self, evs: list[Event]) -> None:
        """This process's writer committed ``evs``."""
        if not self.tail:
            self._publish(evs)
        elif self._subscribers:
            if not evs or evs[-1].position <= self._published:
                return  # a tail read that raced this commit published it already
            if evs[0].position == self._published + 1:
                # nothing of another process's lies between what was published and
                # these (positions commit in order, under the position lock): handed
                # on as they are, not read back from the database
                self._publish(evs)
            else:
                self._wake.set()
        else:
            # Nobody listens: skip reading our own writes back. A new
            # subscriber catches up from the database anyway.
            self._published = max(self._published, evs[-1].position)

    def _publish(self, evs: list[Event]) -> None:
        if evs and evs[0].position <= self._published:
            # a tail read that raced this process's own commit, published already
            evs = [e for e in evs if e.position > self._published]
        if not evs:
            return
        for sub in self._interested(evs):
            sub.offer(evs)
        self._published = max(self._published, evs[-1].position)

    def _interested(self, evs: list[Event]) -> list[_Subscriber]:
        """The subscribers that want some of ``evs``: a commit costs its own sessions'
        watchers, not one look per watcher of every other session (a fleet's hundreds)."""
        subs = list(self._of_all)
        of_session, of_forks = self._of_session, self._of_forks
        if not of_session:
            return subs
        seen: set[str] = set()
        forks = False
        for e in evs:
            sid = e.session_id
            if sid not in seen:
                seen.add(sid)
                subs.extend(of_session.get(sid, ()))
            if of_forks and e.type == T.SESSION_OPENED:
                parent = fork_point(e)
                if parent is not None and parent.get("session_id") in of_forks:
                    subs.extend(of_forks[parent["session_id"]])
                    forks = True
        # a forks' watcher is also its session's: offered a commit once
        return list(dict.fromkeys(subs)) if forks else subs

    def _add(self, sub: _Subscriber) -> None:
        self._subscribers.add(sub)
        if sub.session_id is None:
            self._of_all.add(sub)
            return
        self._of_session.setdefault(sub.session_id, set()).add(sub)
        if sub.with_forks:
            self._of_forks.setdefault(sub.session_id, set()).add(sub)

    def _remove(self, sub: _Subscriber) -> None:
        self._subscribers.discard(sub)
        if sub.session_id is None:
            self._of_all.discard(sub)
            return
        for index in (self._of_session, self._of_forks):
            subs = index.get(sub.session_id)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del index[sub.session_id]

    async def _tail_loop(self) -> None:
        """Pick up committed events from every process, in position order."""
        while not self._closing:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the inner
            # result when a cancel lands in the turn the wake-up does (another
            # replica's NOTIFY as the log closes), so the cancel was lost and close()
            # waited for this loop forever
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.poll_interval_s):
                    await self._wake.wait()
            self._wake.clear()
            if not self._subscribers:
                continue
            try:
                while True:
                    evs = await self._read(self._published, PAGE, None)
                    if evs:
                        self._publish(evs)
                    if len(evs) < PAGE:
                        break
            except Exception:
                log.exception("tailing the log failed; retrying")
                await asyncio.sleep(self.poll_interval_s)

    async def subscribe(
        self, from_position: int = 0, session_id: str | None = None, *, with_forks: bool = False
    ) -> AsyncIterator[Event]:
        """Events with position > ``from_position``: the past from the log, then live.

        ``session_id``: only that session's events; ``with_forks`` adds the
        ``session.opened`` of every session forked from it (what a live session
        document shows). Filtering here, where events are handed out, keeps
        the cost of a committed event to a watcher of another session at one
        comparison instead of a queue hop and a task switch.
        """
        batches = self.subscribe_batches(from_position, session_id, with_forks=with_forks)
        try:
            async for batch in batches:
                for e in batch:
                    yield e
        finally:
            await batches.aclose()  # type: ignore[attr-defined]

    async def subscribe_batches(
        self, from_position: int = 0, session_id: str | None = None, *, with_forks: bool = False
    ) -> AsyncIterator[list[Event]]:
        """:meth:`subscribe`'s events, each time all that are ready: a page of the
        catch-up, or every live event already handed over (a committed run of
        tokens arrives together), so a reader can write them out at once."""
        sub = _Subscriber(session_id, with_forks)
        # forks are other sessions' events: catch-up reads every session's, filtered here
        read_id = None if with_forks else session_id
        self._add(sub)
        metrics.SUBSCRIBERS.inc()
        last = from_position
        # With no tailing (SQLite: one server process writes), every commit this process
        # makes past what it has published is handed on live, and a subscriber from at
        # or past that (the log's end, read just before) has nothing to read back. What
        # another process wrote (a `sessiontape import` or `purge`) is never handed on,
        # as before; a subscriber from the end read from the database starts past it.
        caught_up = not self.tail and last >= self._published
        try:
            while True:
                # catch up from the database
                while not caught_up:
                    evs = await self._read(last, PAGE, read_id)
                    if evs:
                        last = evs[-1].position
                        wanted = [e for e in evs if sub.wants(e)]
                        if wanted:
                            yield wanted
                    if len(evs) < PAGE:
                        break
                caught_up = False  # after an overflow, what was dropped is read back
                sub.overflowed = False
                # live: what is queued now, in one batch (the queue holds no gaps until
                # it overflows; then the rest is read from the database)
                queue = sub.queue
                while not sub.overflowed:
                    items = [sub.take(await queue.get())]
                    while not queue.empty():
                        items.append(sub.take(queue.get_nowait()))
                    if sub.overflowed:
                        break  # a commit was dropped: read it and what follows from the database
                    if len(items) == 1 and items[0][0].position > last:
                        batch = items[0]  # the usual case: one commit, all of it new
                    else:
                        batch = []
                        for item in items:
                            for e in item:
                                if e.position > last and (
                                    not batch or e.position > batch[-1].position
                                ):
                                    batch.append(e)
                    if batch:
                        last = batch[-1].position
                        yield batch
                while not queue.empty():
                    sub.take(queue.get_nowait())
        finally:
            self._remove(sub)
            metrics.SUBSCRIBERS.dec()
