"""Session states: the cache of the fold, locks, TTL expiry and snapshots.

The log is the truth; a :class:`SessionStates` keeps one folded state object
per session in memory (LRU, ``sessions.state_cache_size``; a state under
its lock or generating is never evicted), one lock per session, the idle
clocks behind the TTL sweeper, and the snapshot cadence. Every mutation
goes through :meth:`SessionStates.commit`: append after the state's
version, then fold the committed events into it; a commit a cancel lands in
settles before the cancel goes on, so the cached state always matches the
log. It is the runtime's ``sessions`` part, and the port a generation uses
(:class:`sessiontape.core.generation.host.SessionPort`: lock, open, commit, drop).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar, cast

from sessiontape.core import metrics
from sessiontape.core.config import Config
from sessiontape.core.engine.interface import Engine
from sessiontape.core.errors import ConcurrencyError, SessionClosed, SessionExpired, SessionNotFound
from sessiontape.core.events import Event, NewEvent, T
from sessiontape.core.generation.running import RunningGenerations
from sessiontape.core.log import EventLog
from sessiontape.core.session.loader import load_state
from sessiontape.core.session.snapshot import state_to_json
from sessiontape.core.session.state import EXPIRED, OPEN, PURGED, SessionState, apply
from sessiontape.core.tokens import length_after

log = logging.getLogger("sessiontape.runtime")

#: event types the fold only accepts on an open session (core/session/state.py)
_NEEDS_OPEN = frozenset(
    {
        T.SESSION_CLOSED,
        T.SESSION_ABORTED,
        T.SESSION_EXPIRED,
        T.NODE_FRAGMENT,
        T.ACTION_SUBMITTED,
        T.TOKENS_APPENDED,
        T.TOKENS_TRUNCATED,
        T.IMAGE_ATTACHED,
        T.GENERATION_STARTED,
        T.GENERATION_TOKEN,
        T.GENERATION_FINISHED,
    }
)


#: how often a one-commit command runs again on a reloaded state
STALE_RETRIES = 3

_Cmd = TypeVar("_Cmd", bound=Callable[..., Awaitable[Any]])


def stale_retry(fn: _Cmd) -> _Cmd:
    """Re-run a one-commit command when its commit found the session moved on.

    Another process (a replica on the same PostgreSQL) wrote to the session
    since this process cached its state: ``commit`` drops the stale state
    and raises ConcurrencyError before anything of the command was written.
    The command runs again on the reloaded state, its checks included, so a
    real conflict (an offset that no longer matches, a closed session) still
    gets its typed error; after ``STALE_RETRIES`` the ConcurrencyError stands.
    """

    @functools.wraps(fn)
    async def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        for attempt in range(STALE_RETRIES + 1):
            try:
                return await fn(self, *args, **kwargs)
            except ConcurrencyError:
                if attempt == STALE_RETRIES:
                    raise
                metrics.STALE_RETRIES.inc()
        raise AssertionError("unreachable")

    return cast(_Cmd, run)


class SessionStates:
    """The runtime's session states (see the module docstring)."""

    def __init__(
        self,
        log_: EventLog,
        engine: Engine,
        config: Config,
        clock: Callable[[], float],
        running: RunningGenerations,
    ) -> None:
        self.log = log_
        self.engine = engine
        self.config = config
        self.clock = clock
        self._states: OrderedDict[str, SessionState] = OrderedDict()
        self._locks: dict[str, asyncio.Lock] = {}
        #: the running generations (a generating state is never evicted or expired)
        self.running = running
        self._last_active: dict[str, float] = {}
        self._snapshotted: dict[str, int] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self.cache_size = config.sessions.state_cache_size
        self.snapshot_every = config.log.snapshot_every

    def lock(self, sid: str) -> asyncio.Lock:
        lock = self._locks.get(sid)
        if lock is None:
            lock = self._locks[sid] = asyncio.Lock()
        return lock

    async def load(self, session_id: str, upto_version: int | None = None) -> SessionState:
        """Rebuild a session's state from the log (snapshot, then events; forks via the parent)."""
        return await load_state(self.log, session_id, upto_version)

    async def get(self, session_id: str) -> SessionState:
        """The session's current state (any status). Raises SessionNotFound.

        There is one cached state object per session: when two callers load
        the same session concurrently, the first to finish is kept and the
        other gets that one too.
        """
        st = self._states.get(session_id)
        if st is not None:
            self._states.move_to_end(session_id)
            metrics.STATE_CACHE.labels("hit").inc()
            return st
        metrics.STATE_CACHE.labels("miss").inc()
        loaded = await self.load(session_id)
        st = self._states.get(session_id)
        if st is None:
            st = loaded
            self.keep(st)
        return st

    def keep(self, st: SessionState) -> None:
        """Cache ``st`` as its session's one state object (evicting idle ones past the size)."""
        self._states[st.session_id] = st
        self._states.move_to_end(st.session_id)
        if len(self._states) <= self.cache_size:
            return
        # Evict least recently used states that nobody is working on: a state
        # under its lock or generating must stay the one object writers share.
        for sid in list(self._states):
            if len(self._states) <= self.cache_size:
                break
            lock = self._locks.get(sid)
            if sid in self.running or (lock is not None and lock.locked()) or sid == st.session_id:
                continue
            del self._states[sid]
            self._locks.pop(sid, None)
            self._last_active.pop(sid, None)
            self._snapshotted.pop(sid, None)

    def drop(self, st: SessionState) -> None:
        """Forget a cached state that no longer matches the log (reloaded on next use)."""
        if self._states.get(st.session_id) is st:
            del self._states[st.session_id]

    async def open_locked(self, session_id: str) -> SessionState:
        """Under the session's lock: the open, unexpired state, or the error a client should see."""
        st = await self.get(session_id)
        if st.status == EXPIRED:
            raise SessionExpired(session_id)
        if st.status == PURGED:
            raise SessionNotFound(session_id)
        if st.status != OPEN:
            raise SessionClosed(f"session {session_id} is {st.status}")
        ttl = st.ttl_s
        last = self._last_active.get(session_id, st.updated_at)
        idle = self.clock() - last
        if ttl is not None and idle > ttl and session_id not in self.running:
            await self._expire_locked(st, idle)
            raise SessionExpired(session_id)
        return st

    async def _live(self, session_id: str) -> SessionState:
        async with self.lock(session_id):
            return await self.open_locked(session_id)

    async def commit(
        self,
        st: SessionState,
        new: Sequence[NewEvent],
        *,
        length: int | None = None,
        at_once: bool = True,
    ) -> list[Event]:
        """Append ``new`` after ``st.version`` and fold the committed events into ``st``.

        ``length``: the history length after ``new``, when the caller knows it
        (the token path does; otherwise it is computed from the events).
        ``at_once``: commit it on the spot when the writer is idle
        (:meth:`EventLog.append_now`); False leaves it to the write loop.
        """
        if length is None:
            length = st.length
            for ne in new:
                length = length_after(length, ne.type, ne.body)
        index = {"history_length": length, "last_active_at": self.clock()}

        if st.status != OPEN and any(ne.type in _NEEDS_OPEN for ne in new):
            # never append what the fold would refuse
            raise SessionClosed(f"session {st.session_id} is {st.status}")

        def apply_all(evs: list[Event]) -> list[Event]:
            try:
                for e in evs:
                    apply(st, e)
            except Exception:
                self.drop(st)
                raise
            return evs

        async def append_and_apply() -> list[Event]:
            try:
                evs = await self.log.append(st.session_id, st.version, new, index=index)
            except ConcurrencyError:
                self.drop(st)  # another writer moved the log on: reload next time
                raise
            return apply_all(evs)

        # an idle writer commits right here, with nothing awaited (so nothing to guard)
        now = self.log.append_now(st.session_id, st.version, new, index=index) if at_once else None
        if now is not None:
            evs = apply_all(now)
        else:
            # A caller cancelled mid-commit must neither leave an event in the log
            # that the cached state never saw, nor release the session's lock
            # before the commit settled: wait for it, then let the cancel through.
            task = asyncio.ensure_future(append_and_apply())
            try:
                evs = await asyncio.shield(task)
            except asyncio.CancelledError:
                while not task.done():
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.shield(task)
                raise
        self._last_active[st.session_id] = self.clock()
        if (
            self.snapshot_every
            and st.version - self._snapshotted.get(st.session_id, 0) >= self.snapshot_every
        ):
            self._snapshotted[st.session_id] = st.version
            self._spawn(self._snapshot(st.session_id, state_to_json(st)))
        return evs

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _snapshot(self, sid: str, snap: tuple[int, str, bytes | None]) -> None:
        try:
            await self.log.save_snapshot(sid, *snap)
        except Exception:
            log.exception("snapshot of %s failed", sid)

    # -- expiry --------------------------------------------------------------

    async def _expire_locked(self, st: SessionState, idle_s: float) -> None:
        if st.status == OPEN and st.session_id not in self.running:
            await self.commit(st, [NewEvent(T.SESSION_EXPIRED, {"idle_s": round(idle_s, 3)})])
            metrics.SESSIONS_OPEN.dec()
            self.engine.forget(st.session_id)

    async def live(self, session_id: str) -> SessionState:
        """An open, unexpired session (expiring it if its TTL ran out); no TTL refresh.

        Raises SessionNotFound, SessionExpired or SessionClosed.
        """
        return await self._live(session_id)

    async def touch(self, session_id: str) -> None:
        """Refresh the idle TTL without recording an event."""
        async with self.lock(session_id):
            await self.open_locked(session_id)
            now = self.clock()
            self._last_active[session_id] = now
            await self.log.touch(session_id, now)

    async def expire_idle(self) -> list[str]:
        """One sweeper pass: expire open sessions idle past their TTL."""
        now = self.clock()
        default = self.config.idle_ttl("default")
        expired = []
        for row in await self.log.idle_sessions(now, default):
            if row.id in self.running:
                continue
            last = max(self._last_active.get(row.id, row.last_active_at), row.last_active_at)
            if now - last <= (row.ttl_s if row.ttl_s is not None else default):
                continue
            async with self.lock(row.id):
                st = await self.get(row.id)
                if st.status != OPEN or row.id in self.running:
                    continue
                try:
                    await self._expire_locked(st, now - last)
                except ConcurrencyError:
                    # another replica wrote to it (or expired it) first: it is no
                    # longer this sweep's to expire; the next sweep looks again
                    continue
            expired.append(row.id)
        return expired

    def moved_on(self, session_id: str, version: int) -> None:
        """Another process committed ``version`` of the session: drop a cached state it
        is past, unless the state is under its lock or generating (its commit finds out
        and runs again: :func:`stale_retry`)."""
        st = self._states.get(session_id)
        if st is None or version <= st.version or session_id in self.running:
            return
        lock = self._locks.get(session_id)
        if lock is None or not lock.locked():
            self.drop(st)

    def idle_seconds(self, session_id: str) -> float:
        """Seconds since the session's last activity (its TTL's clock)."""
        st = self._states.get(session_id)
        last = self._last_active.get(session_id, st.updated_at if st else self.clock())
        return max(0.0, self.clock() - last)

    async def aclose(self) -> None:
        """Stop the TTL sweeper and wait for the snapshots under way."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        for t in list(self._background):
            with contextlib.suppress(Exception):
                await t

    def start_sweeper(self) -> None:
        interval = self.config.sessions.sweep_interval_s

        async def loop() -> None:
            while True:
                await asyncio.sleep(interval)
                try:
                    await self.expire_idle()
                except Exception:
                    log.exception("TTL sweep failed")

        self._sweeper = asyncio.create_task(loop(), name="sessiontape-ttl-sweeper")
