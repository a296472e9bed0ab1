"""The runtime: the one API every transport calls.

It owns the event log, the configured engine and the in-memory session
states (a cache of the fold; the log is the truth). Every mutation follows
the same path: take the session's lock, check the command against the
state (raising a typed error that leaves everything unchanged), append the
events, and apply them to the cached state only after they committed.

It is made of named parts, each of one concept:

- ``runtime.sessions``: the session states (the cache of the fold, locks, commits,
  TTL expiry, snapshots: :class:`~sessiontape.core.session.cache.SessionStates`);
- ``runtime.reads``: reads of the log (:class:`~sessiontape.core.session.reads.LogReads`);
- ``runtime.nodes``: Evergreen's node writes (:class:`~sessiontape.core.node_writes.NodeWrites`);
- ``runtime.generations``: generations (:class:`~sessiontape.core.generation.generations.Generations`).

The runtime itself opens, forks, closes and aborts sessions, records events and
appends tokens; :meth:`Runtime.generate`, :meth:`Runtime.generate_runs`,
:meth:`Runtime.get` and :meth:`Runtime.live` delegate to its parts.

Usage::

    rt = await Runtime.create(Config.load())
    s = await rt.open_session("http")
    await rt.append_text(s.session_id, "Hello")
    request = GenerateRequest(SamplingParams(max_tokens=8, seed=1))
    async for ev in rt.generate(s.session_id, request):
        print(ev.type, ev.body)
    await rt.close(s.session_id)
    await rt.aclose()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, cast

from sessiontape.core import metrics
from sessiontape.core.appends import append_events, image_events
from sessiontape.core.bodies import (
    EngineBinding,
    ForkPoint,
    SessionMode,
    session_opened,
)
from sessiontape.core.config import Config
from sessiontape.core.engine.interface import Engine, check_stop_ids
from sessiontape.core.errors import (
    InvalidParameters,
    SessionBusy,
    SessionNotFound,
)
from sessiontape.core.events import Event, NewEvent, T
from sessiontape.core.generation.generations import Generations
from sessiontape.core.generation.policy import RunPolicy
from sessiontape.core.generation.request import GenerateRequest
from sessiontape.core.generation.running import RunningGenerations
from sessiontape.core.generation.scheduler import Admission
from sessiontape.core.log import EventLog
from sessiontape.core.node_writes import NodeWrites
from sessiontape.core.session.cache import SessionStates, stale_retry
from sessiontape.core.session.reads import LogReads
from sessiontape.core.session.state import (
    OPEN,
    PURGED,
    SessionState,
    fork_state,
)
from sessiontape.core.tokens import ImageIn, check_fork_point

log = logging.getLogger("sessiontape.runtime")


Clock = Callable[[], float]


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
    """The API every transport calls, made of named parts (see the module docstring)."""

    def __init__(
        self,
        log_: EventLog,
        engine: Engine,
        config: Config,
        *,
        clock: Clock = time.time,
        policy: RunPolicy | None = None,
    ) -> None:
        """``policy``: the run policy (default: the one ``config.generation`` describes)."""
        self.log = log_
        self.engine = engine
        self.config = config
        self.clock = clock
        running = RunningGenerations()
        self.sessions = SessionStates(log_, engine, config, clock, running)
        self.reads = LogReads(log_)
        self.nodes = NodeWrites(
            self.sessions, config.sessions.max_nesting_depth, config.sessions.max_nodes
        )
        self.generations = Generations(
            engine,
            log_,
            self.sessions,
            running,
            RunPolicy.from_settings(config.generation) if policy is None else policy,
            Admission(config.generation.max_active),
        )
        self._follower: asyncio.Task[None] | None = None

    # -- construction ------------------------------------------------------

    @classmethod
    async def create(
        cls,
        config: Config,
        *,
        engine: Engine | None = None,
        clock: Clock = time.time,
        policy: RunPolicy | None = None,
    ) -> Runtime:
        """Open the log (migrating a fresh database) and load the configured engine."""
        from sessiontape.core.plugins import ENGINES, load

        if engine is None and config.engine_process == "worker":
            from sessiontape.core.engine.worker import WorkerEngine

            engine = WorkerEngine(
                config.engine_name,
                config.engine_options,
                event_loop=config.server.event_loop,
                short_hold_s=config.generation.linger_s,
            )
        elif engine is None:
            factory = load(ENGINES, config.engine_name)
            engine = factory(**config.engine_options)
        assert engine is not None
        info = engine.info
        metrics.ENGINE_PROVIDER.labels(info.name, info.provider, info.model_id).set(1)
        metrics.watch_engine(engine.scheduler_stats)
        log.info("engine %s: model %s on %s", info.name, info.model_id, info.provider)
        log_ = await EventLog.open(
            config.db_url,
            batch_max=config.log.batch_max,
            inline_max_bytes=config.log.inline_max_bytes,
            poll_interval_s=config.log.poll_interval_s,
        )
        rt = cls(log_, engine, config, clock=clock, policy=policy)
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
                    self.sessions.moved_on(e.session_id, e.version)
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
        await self.sessions.aclose()
        await self.engine.aclose()
        await self.log.close()

    # -- sessions ----------------------------------------------------------

    async def get(self, session_id: str) -> SessionState:
        """The session's current state (any status): :meth:`SessionStates.get`."""
        return await self.sessions.get(session_id)

    async def live(self, session_id: str) -> SessionState:
        """An open, unexpired session: :meth:`SessionStates.live`."""
        return await self.sessions.live(session_id)

    async def open_session(
        self,
        protocol: str,
        *,
        mode: str = "offset",
        label: str = "",
        eos_token_ids: Sequence[int] | None = None,
        ttl_s: float | None = None,
        meta: Mapping[str, Any] | None = None,
        session_id: str | None = None,
    ) -> SessionState:
        """Start a session bound to the configured engine; the server issues its id."""
        if mode not in ("offset", "append_only"):
            raise InvalidParameters(f"unknown session mode {mode!r}")
        check_labels(protocol, label, session_id)
        sid = session_id or new_session_id()
        info = self.engine.info
        if eos_token_ids is not None:
            check_stop_ids(eos_token_ids, "eos_token_ids")
        eos = list(info.eos_token_ids if eos_token_ids is None else eos_token_ids)
        # opaque ids the application supplies (kakeya.v1): an id the model never
        # emits never matches; only the history's tokens are range-checked
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < 2**32 for t in eos):
            raise InvalidParameters("eos_token_ids must be integers in [0, 2**32)")
        body = session_opened(
            protocol=protocol,
            mode=cast(SessionMode, mode),  # checked against the two modes above
            label=label,
            eos_token_ids=eos,
            ttl_s=self.config.idle_ttl(protocol) if ttl_s is None else ttl_s,
            engine=cast(EngineBinding, info.provenance()),
            meta=dict(meta or {}),
            parent=None,
        )
        st = SessionState(sid)
        await self.sessions.commit(st, [NewEvent(T.SESSION_OPENED, body)])
        self.sessions.keep(st)
        metrics.SESSIONS_OPENED.labels(protocol).inc()
        metrics.SESSIONS_OPEN.inc()
        return st

    async def fork(
        self,
        session_id: str,
        *,
        at_position: int | None = None,
        at_version: int | None = None,
        protocol: str | None = None,
        label: str = "",
    ) -> SessionState:
        """A new session continuing ``session_id`` at a token position or an event version.

        Nothing is copied in the log: the child's ``session.opened`` names the
        parent, its version and the token position; loading the child folds
        the parent up to there.
        """
        check_labels(protocol or "", label, None)
        parent = await self.sessions.get(session_id)
        if parent.status == PURGED:
            raise SessionNotFound(session_id)
        if at_version is not None:
            if not 1 <= at_version <= parent.version:
                raise InvalidParameters(
                    f"fork version {at_version} is outside [1, {parent.version}]"
                )
            base = await self.sessions.load(session_id, at_version)
        else:
            base = parent
        if at_position is not None:
            check_fork_point(base, at_position)
        sid = new_session_id()
        st = fork_state(base, sid, at_position)
        pinfo: ForkPoint = {
            "session_id": session_id,
            "version": base.version,
            "token_position": at_position,
        }
        st.parent = dict(pinfo)
        body = session_opened(
            protocol=protocol or parent.protocol,
            mode=cast(SessionMode, parent.mode),
            label=label or parent.label,
            eos_token_ids=parent.eos_token_ids,
            ttl_s=parent.ttl_s,
            engine=cast(EngineBinding, self.engine.info.provenance()),
            meta=dict(parent.meta),
            parent=pinfo,
        )
        await self.sessions.commit(st, [NewEvent(T.SESSION_OPENED, body)])
        self.sessions.keep(st)
        if at_position is not None:
            self.engine.fork(session_id, sid, at_position)
        metrics.SESSIONS_OPENED.labels(st.protocol).inc()
        metrics.SESSIONS_OPEN.inc()
        return st

    @stale_retry
    async def close(self, session_id: str, reason: str = "client") -> SessionState:
        """Close a session; closing a closed one is a no-op. Raises SessionNotFound,
        SessionBusy while it generates."""
        async with self.sessions.lock(session_id):
            st = await self.sessions.get(session_id)
            if st.status != OPEN:
                return st
            if session_id in self.generations.running:
                raise SessionBusy(session_id)
            await self.sessions.commit(st, [NewEvent(T.SESSION_CLOSED, {"reason": reason})])
        self.engine.forget(session_id)
        metrics.SESSIONS_OPEN.dec()
        return st

    async def abort(self, session_id: str, code: str, message: str) -> SessionState:
        """Record a protocol abort (the transport ends the stream with an error).

        A running generation is stopped first (finished as ``aborted``), so
        nothing is generated after the abort.
        """
        await self.generations.stop(session_id)
        st = await self._record_abort(session_id, code, message)
        self.engine.forget(session_id)
        return st

    @stale_retry
    async def _record_abort(self, session_id: str, code: str, message: str) -> SessionState:
        async with self.sessions.lock(session_id):
            st = await self.sessions.get(session_id)
            if st.status == OPEN:
                await self.sessions.commit(
                    st, [NewEvent(T.SESSION_ABORTED, {"code": code, "message": message})]
                )
                metrics.SESSIONS_OPEN.dec()
        return st

    # -- content -----------------------------------------------------------

    @stale_retry
    async def record(self, session_id: str, new: Sequence[NewEvent]) -> list[Event]:
        """Append events that carry no model rule (wire messages, notes, feedback)
        to a session in any state but purged."""
        async with self.sessions.lock(session_id):
            st = await self.sessions.get(session_id)
            if st.status == PURGED:
                raise SessionNotFound(session_id)
            return await self.sessions.commit(st, new)

    async def record_wire(
        self, session_id: str, transport: str, direction: str, payload: Any
    ) -> Event:
        return (
            await self.record(
                session_id,
                [
                    NewEvent(
                        T.WIRE, {"transport": transport, "direction": direction, "payload": payload}
                    )
                ],
            )
        )[0]

    async def record_feedback(self, session_id: str, feedback: Mapping[str, Any]) -> Event:
        return (await self.record(session_id, [NewEvent(T.FEEDBACK, dict(feedback))]))[0]

    async def record_error(self, session_id: str, code: str, message: str) -> Event:
        return (
            await self.record(session_id, [NewEvent(T.ERROR, {"code": code, "message": message})])
        )[0]

    @stale_retry
    async def append_tokens(
        self,
        session_id: str,
        tokens: Sequence[int],
        *,
        offset: int | None = None,
        truncating: bool = False,
        images: Sequence[ImageIn] = (),
    ) -> int:
        """Append tokens (Salience offset rule when ``offset`` is given); returns the new length."""
        async with self.sessions.lock(session_id):
            st = await self.sessions.open_locked(session_id)
            if session_id in self.generations.running:
                raise SessionBusy(session_id)
            notes, shas = image_events(images)
            new = append_events(self.engine, st, tokens, offset, truncating, images, shas)
            if new:
                await self.sessions.commit(st, notes + new)
            return st.length

    async def append_text(self, session_id: str, text: str) -> int:
        return await self.append_tokens(session_id, self.engine.tokenize(text))

    # -- generation --------------------------------------------------------

    def generate(self, session_id: str, request: GenerateRequest) -> AsyncIterator[Event]:
        """The request's generation on the session, one committed event at a time
        (:meth:`Generations.events`, see there)."""
        return self.generations.events(session_id, request)

    def generate_runs(
        self, session_id: str, request: GenerateRequest
    ) -> AsyncIterator[list[Event]]:
        """The request's generation in runs, each the events of one commit
        (:meth:`Generations.runs`, see there)."""
        return self.generations.runs(session_id, request)
