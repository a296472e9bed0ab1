"""The runtime: the one API every transport calls.

It owns the event log, the configured engine and the in-memory session
states (a cache of the fold; the log is the truth). Every mutation follows
the same path: take the session's lock, check the command against the
state (raising a typed error that leaves everything unchanged), append the
events, and apply them to the cached state only after they committed.

Usage::

    rt = await Runtime.create(Config.load())
    s = await rt.open_session("http")
    await rt.append_text(s.session_id, "Hello")
    async for ev in rt.generate(s.session_id, SamplingParams(max_tokens=8, seed=1)):
        print(ev.type, ev.body)
    await rt.close(s.session_id)
    await rt.aclose()
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

from core import document, metrics
from core.config import Config
from core.engine import DEFAULT_OUTPUT, Engine, OutputOptions, SamplingParams
from core.errors import (
    ConcurrencyError,
    InvalidAction,
    InvalidParameters,
    ResourceExhausted,
    SessionBusy,
    SessionClosed,
    SessionExpired,
    SessionNotFound,
)
from core.events import Event, NewEvent, T
from core.generation import PipelineLimits, generate_runs
from core.loader import load_state
from core.log import EventLog, SessionRow
from core.nodes import FragmentIn, check_fragment
from core.scheduler import PriorityGate
from core.snapshot import state_to_json
from core.state import (
    EXPIRED,
    OPEN,
    PURGED,
    SessionState,
    apply,
    fork_state,
    overlay,
    overlay_apply,
)
from core.tokens import (
    ImageIn,
    check_fork_point,
    check_images,
    check_length,
    check_vocab,
    length_after,
    rewind_point,
)

log = logging.getLogger("sessiontape.runtime")

#: event types the fold only accepts on an open session (core/state.py)
_NEEDS_OPEN = frozenset({
    T.SESSION_CLOSED, T.SESSION_ABORTED, T.SESSION_EXPIRED, T.NODE_FRAGMENT, T.ACTION_SUBMITTED,
    T.TOKENS_APPENDED, T.TOKENS_TRUNCATED, T.IMAGE_ATTACHED, T.GENERATION_STARTED, T.GENERATION_TOKEN,
    T.GENERATION_FINISHED,
})

Clock = Callable[[], float]

#: how often a command whose cached state turned out stale is re-run on a reloaded one
STALE_RETRIES = 3

_Cmd = TypeVar("_Cmd", bound=Callable[..., Awaitable[Any]])


def stale_retry(fn: _Cmd) -> _Cmd:
    """Re-run a one-commit command when its commit found the session moved on.

    Another process (a replica on the same PostgreSQL) wrote to the session
    since this process cached its state: ``_commit`` drops the stale state
    and raises ConcurrencyError before anything of the command was written.
    The command runs again on the reloaded state, its checks included, so a
    real conflict (an offset that no longer matches, a closed session) still
    gets its typed error; after ``STALE_RETRIES`` the ConcurrencyError stands.
    """
    @functools.wraps(fn)
    async def run(self: Runtime, *args: Any, **kwargs: Any) -> Any:
        for attempt in range(STALE_RETRIES + 1):
            try:
                return await fn(self, *args, **kwargs)
            except ConcurrencyError:
                if attempt == STALE_RETRIES:
                    raise
                metrics.STALE_RETRIES.inc()
        raise AssertionError("unreachable")

    return cast(_Cmd, run)


def new_session_id() -> str:
    return "s_" + secrets.token_hex(12)


def check_labels(protocol: str, label: str, session_id: str | None) -> None:
    """Bounds of the sessions-index columns, checked before anything is written."""
    if len(protocol) > 32:
        raise InvalidParameters("protocol must be at most 32 characters")
    if len(label) > 1000:
        raise InvalidParameters("label must be at most 1000 characters")
    if session_id is not None and not 0 < len(session_id) <= 64:
        raise InvalidParameters("session id must be 1 to 64 characters")


class Runtime:
    def __init__(self, log_: EventLog, engine: Engine, config: Config, *, clock: Clock = time.time) -> None:
        self.log = log_
        self.engine = engine
        self.config = config
        self.clock = clock
        self._states: OrderedDict[str, SessionState] = OrderedDict()
        self._locks: dict[str, asyncio.Lock] = {}
        self._generating: set[str] = set()
        self._last_active: dict[str, float] = {}
        self._snapshotted: dict[str, int] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._follower: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self.gate = PriorityGate()
        #: Kakeya counters: session id -> [INV-1 violations, INV-2 violations]
        self.invariant_violations: dict[str, list[int]] = {}
        self.max_depth = int(config.sessions_opt("max_nesting_depth"))
        self.max_nodes = int(config.sessions_opt("max_nodes"))
        #: generating sessions -> set when their generation ends (abort waits on it)
        self._gen_idle: dict[str, asyncio.Event] = {}
        self._stop_requested: set[str] = set()
        self.cache_size = int(config.sessions_opt("state_cache_size"))
        self.snapshot_every = int(config.log_opt("snapshot_every"))
        self.pipeline = PipelineLimits(
            run_ahead=int(config.generation_opt("run_ahead")), max_run=int(config.generation_opt("max_run")),
            min_run=int(config.generation_opt("min_run")), linger_s=float(config.generation_opt("linger_s")),
            burst=int(config.generation_opt("burst")))

    # -- construction ------------------------------------------------------

    @classmethod
    async def create(cls, config: Config, *, engine: Engine | None = None, clock: Clock = time.time) -> Runtime:
        """Open the log (migrating a fresh database) and load the configured engine."""
        from core.registry import ENGINES, load

        if engine is None:
            factory = load(ENGINES, config.engine_name)
            engine = factory(**config.engine_options)
        assert engine is not None
        info = engine.info
        metrics.ENGINE_PROVIDER.labels(info.name, info.provider, info.model_id).set(1)
        log.info("engine %s: model %s on %s", info.name, info.model_id, info.provider)
        log_ = await EventLog.open(
            config.db_url,
            batch_max=int(config.log_opt("batch_max")),
            inline_max_bytes=int(config.log_opt("inline_max_bytes")),
            poll_interval_s=float(config.log_opt("poll_interval_s")),
        )
        rt = cls(log_, engine, config, clock=clock)
        if log_.shared:
            rt._follower = asyncio.create_task(rt._follow(), name="sessiontape-state-follower")
        return rt

    async def _follow(self) -> None:
        """Replicas: drop a cached state as soon as another process writes to its session.

        The log is tailed anyway (LISTEN/NOTIFY plus polling); an event whose
        version is past the cached state's is another process's, so the state
        is reloaded on next use instead of failing a commit first. A state
        under its lock or generating is left alone: its commit finds out and
        retries (``stale_retry``).
        """
        while True:
            try:
                async for e in self.log.subscribe(await self.log.last_position()):
                    st = self._states.get(e.session_id)
                    if st is None or e.version <= st.version or e.session_id in self._generating:
                        continue
                    lock = self._locks.get(e.session_id)
                    if lock is None or not lock.locked():
                        self._drop(st)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("following the log for other processes' writes failed; retrying")
                await asyncio.sleep(1.0)

    async def aclose(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follower
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        for t in list(self._background):
            with contextlib.suppress(Exception):
                await t
        await self.engine.aclose()
        await self.log.close()

    # -- state -------------------------------------------------------------

    def _lock(self, sid: str) -> asyncio.Lock:
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
            self._cache(st)
        return st

    def _cache(self, st: SessionState) -> None:
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
            if sid in self._generating or (lock is not None and lock.locked()) or sid == st.session_id:
                continue
            del self._states[sid]
            self._locks.pop(sid, None)
            self._last_active.pop(sid, None)
            self._snapshotted.pop(sid, None)

    def _drop(self, st: SessionState) -> None:
        """Forget a cached state that no longer matches the log (reloaded on next use)."""
        if self._states.get(st.session_id) is st:
            del self._states[st.session_id]

    async def _open_locked(self, session_id: str) -> SessionState:
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
        if ttl is not None and idle > ttl and session_id not in self._generating:
            await self._expire_locked(st, idle)
            raise SessionExpired(session_id)
        return st

    async def _live(self, session_id: str) -> SessionState:
        async with self._lock(session_id):
            return await self._open_locked(session_id)

    async def _commit(self, st: SessionState, new: Sequence[NewEvent], *, length: int | None = None) -> list[Event]:
        """Append ``new`` after ``st.version`` and fold the committed events into ``st``.

        ``length``: the history length after ``new``, when the caller knows it
        (the token path does; otherwise it is computed from the events).
        """
        if length is None:
            length = st.length
            for ne in new:
                length = length_after(length, ne.type, dict(ne.body))
        index = {"history_length": length, "last_active_at": self.clock()}

        if st.status != OPEN and any(ne.type in _NEEDS_OPEN for ne in new):
            # never append what the fold would refuse
            raise SessionClosed(f"session {st.session_id} is {st.status}")

        async def append_and_apply() -> list[Event]:
            try:
                evs = await self.log.append(st.session_id, st.version, new, index=index)
            except ConcurrencyError:
                self._drop(st)  # another writer moved the log on: reload next time
                raise
            try:
                for e in evs:
                    apply(st, e)
            except Exception:
                self._drop(st)
                raise
            return evs

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
        if self.snapshot_every and st.version - self._snapshotted.get(st.session_id, 0) >= self.snapshot_every:
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

    # -- sessions ----------------------------------------------------------

    async def open_session(self, protocol: str, *, mode: str = "offset", label: str = "",
                           eos_token_ids: Sequence[int] | None = None, ttl_s: float | None = None,
                           meta: Mapping[str, Any] | None = None, session_id: str | None = None) -> SessionState:
        """Start a session bound to the configured engine; the server issues its id."""
        if mode not in ("offset", "append_only"):
            raise InvalidParameters(f"unknown session mode {mode!r}")
        check_labels(protocol, label, session_id)
        sid = session_id or new_session_id()
        info = self.engine.info
        eos = list(info.eos_token_ids if eos_token_ids is None else eos_token_ids)
        # opaque ids the application supplies (kakeya.v1): an id the model never
        # emits never matches; only the history's tokens are range-checked
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < 2**32 for t in eos):
            raise InvalidParameters("eos_token_ids must be integers in [0, 2**32)")
        body = {
            "protocol": protocol, "mode": mode, "label": label, "eos_token_ids": eos,
            "ttl_s": self.config.idle_ttl(protocol) if ttl_s is None else ttl_s,
            "engine": info.provenance(), "meta": dict(meta or {}), "parent": None,
        }
        st = SessionState(sid)
        await self._commit(st, [NewEvent(T.SESSION_OPENED, body)])
        self._cache(st)
        metrics.SESSIONS_OPENED.labels(protocol).inc()
        metrics.SESSIONS_OPEN.inc()
        return st

    async def fork(self, session_id: str, *, at_position: int | None = None, at_version: int | None = None,
                   protocol: str | None = None, label: str = "") -> SessionState:
        """A new session continuing ``session_id`` at a token position or an event version.

        Nothing is copied in the log: the child's ``session.opened`` names the
        parent, its version and the token position; loading the child folds
        the parent up to there.
        """
        check_labels(protocol or "", label, None)
        parent = await self.get(session_id)
        if parent.status == PURGED:
            raise SessionNotFound(session_id)
        if at_version is not None:
            if not 1 <= at_version <= parent.version:
                raise InvalidParameters(f"fork version {at_version} is outside [1, {parent.version}]")
            base = await self.load(session_id, at_version)
        else:
            base = parent
        if at_position is not None:
            check_fork_point(base, at_position)
        sid = new_session_id()
        st = fork_state(base, sid, at_position)
        pinfo = {"session_id": session_id, "version": base.version, "token_position": at_position}
        st.parent = pinfo
        body = {
            "protocol": protocol or parent.protocol, "mode": parent.mode, "label": label or parent.label,
            "eos_token_ids": parent.eos_token_ids, "ttl_s": parent.ttl_s, "engine": self.engine.info.provenance(),
            "meta": dict(parent.meta), "parent": pinfo,
        }
        await self._commit(st, [NewEvent(T.SESSION_OPENED, body)])
        self._cache(st)
        if at_position is not None:
            self.engine.fork(session_id, sid, at_position)
        metrics.SESSIONS_OPENED.labels(st.protocol).inc()
        metrics.SESSIONS_OPEN.inc()
        return st

    @stale_retry
    async def close(self, session_id: str, reason: str = "client") -> SessionState:
        """Close a session; closing a closed one is a no-op. Raises SessionNotFound,
        SessionBusy while it generates."""
        async with self._lock(session_id):
            st = await self.get(session_id)
            if st.status != OPEN:
                return st
            if session_id in self._generating:
                raise SessionBusy(session_id)
            await self._commit(st, [NewEvent(T.SESSION_CLOSED, {"reason": reason})])
        self.engine.forget(session_id)
        metrics.SESSIONS_OPEN.dec()
        return st

    async def abort(self, session_id: str, code: str, message: str) -> SessionState:
        """Record a protocol abort (the transport ends the stream with an error).

        A running generation is stopped first (finished as ``aborted``), so
        nothing is generated after the abort.
        """
        idle = self._gen_idle.get(session_id)
        if idle is not None:
            self._stop_requested.add(session_id)
            await idle.wait()
        st = await self._record_abort(session_id, code, message)
        self.engine.forget(session_id)
        return st

    @stale_retry
    async def _record_abort(self, session_id: str, code: str, message: str) -> SessionState:
        async with self._lock(session_id):
            st = await self.get(session_id)
            if st.status == OPEN:
                await self._commit(st, [NewEvent(T.SESSION_ABORTED, {"code": code, "message": message})])
                metrics.SESSIONS_OPEN.dec()
        return st

    async def _expire_locked(self, st: SessionState, idle_s: float) -> None:
        if st.status == OPEN and st.session_id not in self._generating:
            await self._commit(st, [NewEvent(T.SESSION_EXPIRED, {"idle_s": round(idle_s, 3)})])
            metrics.SESSIONS_OPEN.dec()
            self.engine.forget(st.session_id)

    async def live(self, session_id: str) -> SessionState:
        """An open, unexpired session (expiring it if its TTL ran out); no TTL refresh.

        Raises SessionNotFound, SessionExpired or SessionClosed.
        """
        return await self._live(session_id)

    async def touch(self, session_id: str) -> None:
        """Refresh the idle TTL without recording an event."""
        async with self._lock(session_id):
            await self._open_locked(session_id)
            now = self.clock()
            self._last_active[session_id] = now
            await self.log.touch(session_id, now)

    async def expire_idle(self) -> list[str]:
        """One sweeper pass: expire open sessions idle past their TTL."""
        now = self.clock()
        default = self.config.idle_ttl("default")
        expired = []
        for row in await self.log.idle_sessions(now, default):
            if row.id in self._generating:
                continue
            last = max(self._last_active.get(row.id, row.last_active_at), row.last_active_at)
            if now - last <= (row.ttl_s if row.ttl_s is not None else default):
                continue
            async with self._lock(row.id):
                st = await self.get(row.id)
                if st.status != OPEN or row.id in self._generating:
                    continue
                try:
                    await self._expire_locked(st, now - last)
                except ConcurrencyError:
                    # another replica wrote to it (or expired it) first: it is no
                    # longer this sweep's to expire; the next sweep looks again
                    continue
            expired.append(row.id)
        return expired

    def start_sweeper(self) -> None:
        interval = float(self.config.sessions_opt("sweep_interval_s"))

        async def loop() -> None:
            while True:
                await asyncio.sleep(interval)
                try:
                    await self.expire_idle()
                except Exception:
                    log.exception("TTL sweep failed")

        self._sweeper = asyncio.create_task(loop(), name="sessiontape-ttl-sweeper")

    # -- content -----------------------------------------------------------

    @stale_retry
    async def record(self, session_id: str, new: Sequence[NewEvent]) -> list[Event]:
        """Append events that carry no model rule (wire messages, notes, feedback)
        to a session in any state but purged."""
        async with self._lock(session_id):
            st = await self.get(session_id)
            if st.status == PURGED:
                raise SessionNotFound(session_id)
            return await self._commit(st, new)

    async def record_wire(self, session_id: str, transport: str, direction: str, payload: Any) -> Event:
        return (await self.record(session_id, [NewEvent(T.WIRE, {"transport": transport, "direction": direction, "payload": payload})]))[0]

    async def record_feedback(self, session_id: str, feedback: Mapping[str, Any]) -> Event:
        return (await self.record(session_id, [NewEvent(T.FEEDBACK, dict(feedback))]))[0]

    async def record_error(self, session_id: str, code: str, message: str) -> Event:
        return (await self.record(session_id, [NewEvent(T.ERROR, {"code": code, "message": message})]))[0]

    @stale_retry
    async def append_fragments(self, session_id: str, fragments: Sequence[FragmentIn],
                               direction: str = "in") -> list[bool]:
        """Record Evergreen fragments; returns, per fragment, False for an ignored duplicate.

        All-or-nothing: if any fragment breaks a rule nothing is recorded.
        """
        async with self._lock(session_id):
            st = await self._open_locked(session_id)
            # Later fragments of one message are checked against the earlier
            # ones, on a copy-on-write overlay of the touched nodes only.
            scratch = overlay(st) if len(fragments) > 1 else st
            new: list[NewEvent] = []
            kept: list[bool] = []
            fresh: set[str] = set()
            for f in fragments:
                ok = check_fragment(scratch, f, self.max_depth)
                kept.append(ok)
                if ok:
                    if f.id not in st.nodes:
                        fresh.add(f.id)
                    ne = NewEvent(T.NODE_FRAGMENT, f.body(direction), f.data)
                    new.append(ne)
                    if scratch is not st:
                        overlay_apply(scratch, st, ne.body, ne.data)
            if len(st.nodes) + len(fresh) > self.max_nodes:
                raise ResourceExhausted(f"session {session_id} would hold more than {self.max_nodes} nodes")
            if new:
                await self._commit(st, new)
            return kept

    @stale_retry
    async def submit_action(self, session_id: str, name: str, inputs: Sequence[tuple[str, str]],
                            outputs: Sequence[tuple[str, str]], *, target: str = "",
                            configs: Sequence[Any] = (), action_id: str | None = None) -> Event:
        """Record an action; output ids must be new node ids."""
        async with self._lock(session_id):
            st = await self._open_locked(session_id)
            if not name:
                raise InvalidAction("action without a name")
            seen: set[str] = set()
            for _, nid in outputs:
                if nid in st.nodes or nid in seen or any(nid in [o for _, o in a.outputs] for a in st.actions.values()):
                    raise InvalidAction(f"output id {nid!r} is not new")
                seen.add(nid)
            aid = action_id or f"a{len(st.actions) + 1}"
            body = {"action_id": aid, "name": name, "inputs": [{"name": n, "id": i} for n, i in inputs],
                    "outputs": [{"name": n, "id": i} for n, i in outputs], "target": target, "configs": list(configs)}
            return (await self._commit(st, [NewEvent(T.ACTION_SUBMITTED, body)]))[0]

    @stale_retry
    async def finish_action(self, session_id: str, action_id: str, error: tuple[str, str] | None = None) -> Event:
        async with self._lock(session_id):
            st = await self.get(session_id)
            if error is None:
                ne = NewEvent(T.ACTION_COMPLETED, {"action_id": action_id})
            else:
                ne = NewEvent(T.ACTION_FAILED, {"action_id": action_id, "code": error[0], "message": error[1]})
            return (await self._commit(st, [ne]))[0]

    def _append_events(self, st: SessionState, tokens: Sequence[int], offset: int | None, truncating: bool,
                       images: Sequence[ImageIn], image_blobs: list[tuple[str, int]]) -> list[NewEvent]:
        """Check an append against ``st`` and build its events (no mutation)."""
        info = self.engine.info
        tokens = [int(t) for t in tokens]
        check_vocab(tokens, info.vocab_size)
        cut = rewind_point(st, offset, truncating)
        base = st.length if cut is None else cut
        new_len = base + len(tokens)
        check_length(new_len, info.max_length)
        if images:
            block = None if info.image_block_tokens is None else self.engine.image_block_length(images[0].data, images[0].mime)
            check_images(images, base, new_len, block, tokens, info.image_pad_token_id)
        out: list[NewEvent] = []
        if cut is not None:
            out.append(NewEvent(T.TOKENS_TRUNCATED, {"reason": "rewind", "keep": [[0, cut]], "dropped": st.length - cut}))
        if tokens or images:
            imgs = [{"start": im.start, "end": im.end, "mime": im.mime, "sha256": sha, "size": size}
                    for im, (sha, size) in zip(images, image_blobs, strict=True)]
            out.append(NewEvent(T.TOKENS_APPENDED, {"start": base, "tokens": tokens, "images": imgs}))
        return out

    async def _image_events(self, images: Sequence[ImageIn]) -> tuple[list[NewEvent], list[tuple[str, int]]]:
        import hashlib

        notes, shas = [], []
        for im in images:
            sha = hashlib.sha256(im.data).hexdigest()
            shas.append((sha, len(im.data)))
            notes.append(NewEvent(T.IMAGE_ATTACHED, {"sha256": sha, "mime": im.mime, "size": len(im.data)}, im.data))
        return notes, shas

    @stale_retry
    async def append_tokens(self, session_id: str, tokens: Sequence[int], *, offset: int | None = None,
                            truncating: bool = False, images: Sequence[ImageIn] = ()) -> int:
        """Append tokens (Salience offset rule when ``offset`` is given); returns the new length."""
        async with self._lock(session_id):
            st = await self._open_locked(session_id)
            if session_id in self._generating:
                raise SessionBusy(session_id)
            notes, shas = await self._image_events(images)
            new = self._append_events(st, tokens, offset, truncating, images, shas)
            if new:
                await self._commit(st, notes + new)
            return st.length

    async def append_text(self, session_id: str, text: str) -> int:
        return await self.append_tokens(session_id, self.engine.tokenize(text))

    # -- generation --------------------------------------------------------

    async def generate(self, session_id: str, params: SamplingParams, options: OutputOptions = DEFAULT_OUTPUT, *,
                       append: Sequence[int] = (), offset: int | None = None, truncating: bool = False,
                       images: Sequence[ImageIn] = (), priority: int = 0, action_id: str | None = None,
                       sink_window: tuple[int, int] | None = None) -> AsyncIterator[Event]:
        """Append (optionally), prefill and decode; yields each committed event.

        Yields ``tokens.truncated`` (a rewind, or sink+window at most once),
        ``generation.started``, ``generation.token`` per scored prompt
        position and per generated token, then ``generation.finished``. Every
        check happens before the first commit, which holds the append, any
        truncation and ``generation.started`` together. A second concurrent
        generate on the session raises SessionBusy. If the caller stops
        iterating, the generation is recorded as ``cancelled``; an engine
        failure as ``error`` with an ``error.recorded`` event. Without a seed,
        one is drawn and recorded, so every generation can be re-executed.

        The same as :meth:`generate_runs`, one event at a time.
        """
        runs = self.generate_runs(session_id, params, options, append=append, offset=offset,
                                  truncating=truncating, images=images, priority=priority,
                                  action_id=action_id, sink_window=sink_window)
        try:
            async for run in runs:
                for e in run:
                    yield e
        finally:
            # abandoned without aclose, both generators are finalized by the loop at
            # once: the inner one may be closing already
            with contextlib.suppress(RuntimeError):
                await runs.aclose()  # type: ignore[attr-defined]

    def generate_runs(self, session_id: str, params: SamplingParams, options: OutputOptions = DEFAULT_OUTPUT, *,
                      append: Sequence[int] = (), offset: int | None = None, truncating: bool = False,
                      images: Sequence[ImageIn] = (), priority: int = 0, action_id: str | None = None,
                      sink_window: tuple[int, int] | None = None) -> AsyncIterator[list[Event]]:
        """:meth:`generate` in runs: each item is the events of one commit.

        The engine decodes ahead of the log (at most ``generation.run_ahead``
        steps) while runs commit; a transport that writes a whole run at once
        pays its per-message cost once per run (core/generation.py).
        """
        return generate_runs(self, session_id, params, options, append=append, offset=offset,
                             truncating=truncating, images=images, priority=priority, action_id=action_id,
                             sink_window=sink_window)

    def _begin_generation(self, session_id: str) -> None:
        self._generating.add(session_id)
        self._gen_idle[session_id] = asyncio.Event()

    def _end_generation(self, session_id: str) -> None:
        self._generating.discard(session_id)
        self._stop_requested.discard(session_id)
        idle = self._gen_idle.pop(session_id, None)
        if idle is not None:
            idle.set()

    def _violation(self, session_id: str, which: int) -> None:
        counts = self.invariant_violations.setdefault(session_id, [0, 0])
        counts[which - 1] += 1
        metrics.INVARIANT_VIOLATIONS.labels(f"INV-{which}").inc()

    def is_generating(self, session_id: str) -> bool:
        return session_id in self._generating

    def idle_seconds(self, session_id: str) -> float:
        st = self._states.get(session_id)
        last = self._last_active.get(session_id, st.updated_at if st else self.clock())
        return max(0.0, self.clock() - last)

    # -- reading -----------------------------------------------------------

    def subscribe(self, from_position: int = 0, session_id: str | None = None) -> AsyncIterator[Event]:
        """Committed events after ``from_position`` (catch-up, then live)."""
        return self.log.subscribe(from_position, session_id)

    # -- the log, for transports (they ask the runtime, never the log) ---------

    async def read_events(self, session_id: str, from_version: int = 1,
                          to_version: int | None = None) -> list[Event]:
        """A session's committed events in version order, ``from_version`` to ``to_version`` inclusive
        (empty for an unknown session)."""
        return await self.log.read(session_id, from_version, to_version)

    async def read_after(self, after_position: int = 0, *, limit: int = 1000,
                         session_id: str | None = None) -> list[Event]:
        """Committed events with position > ``after_position`` in position order (one session's, or all)."""
        return await self.log.read_all(after_position, limit=limit, session_id=session_id)

    async def last_position(self) -> int:
        """The position of the newest committed event (0 for an empty log): a resume cursor."""
        return await self.log.last_position()

    async def session_row(self, session_id: str) -> SessionRow:
        """The session's row in the sessions index; raises SessionNotFound."""
        return await self.log.get_session(session_id)

    async def list_sessions(self, *, status: str | None = None, protocol: str | None = None,
                            parent_id: str | None = None, limit: int = 1000, offset: int = 0,
                            newest_first: bool = True, active_after: float | None = None) -> list[SessionRow]:
        """Rows of the sessions index (see :meth:`core.log.EventLog.list_sessions`)."""
        return await self.log.list_sessions(status=status, protocol=protocol, parent_id=parent_id, limit=limit,
                                            offset=offset, newest_first=newest_first, active_after=active_after)

    async def get_blob(self, sha256: str) -> bytes | None:
        """A content-addressed payload (chunk or image bytes), None when the log has none."""
        return await self.log.get_blob(sha256)

    @property
    def inline_max_bytes(self) -> int:
        """Payloads larger than this are stored as blobs, not in their event."""
        return self.log.inline_max_bytes

    async def fork_base(self, first: Event) -> SessionState | None:
        """The state a fork starts from, given the fork's first event; None when it is no fork."""
        return await document.fork_base(self.log, first)
