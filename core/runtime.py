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
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, cast

from sessiontape.core import metrics
from sessiontape.core.bodies import (
    EngineBinding,
    ForkPoint,
    SessionMode,
    session_opened,
    tokens_truncated,
)
from sessiontape.core.config import Config
from sessiontape.core.engine.interface import DEFAULT_OUTPUT, Engine, OutputOptions, SamplingParams
from sessiontape.core.errors import (
    InvalidParameters,
    SessionBusy,
    SessionNotFound,
)
from sessiontape.core.events import Event, NewEvent, T
from sessiontape.core.generate_request import GenerateRequest, RunHook
from sessiontape.core.generation import generate_runs
from sessiontape.core.log import EventLog
from sessiontape.core.node_writes import NodeWrites
from sessiontape.core.pipeline import PipelineLimits
from sessiontape.core.scheduler import Admission, PriorityGate
from sessiontape.core.session.cache import stale_retry
from sessiontape.core.session.reads import LogReads
from sessiontape.core.session.state import (
    OPEN,
    PURGED,
    SessionState,
    fork_state,
)
from sessiontape.core.tokens import (
    ImageIn,
    check_fork_point,
    check_images,
    check_length,
    check_vocab,
    rewind_point,
)

log = logging.getLogger("sessiontape.runtime")


Clock = Callable[[], float]


#: how often a command whose cached state turned out stale is re-run on a reloaded one
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


class Runtime(NodeWrites, LogReads):
    """The API every transport calls (session states, locks and expiry: core/session/cache.py;
    a generation: core/generation.py and core/pipeline.py; reads of the log: core/session/reads.py)."""

    def __init__(
        self, log_: EventLog, engine: Engine, config: Config, *, clock: Clock = time.time
    ) -> None:
        super().__init__(log_, engine, config, clock)
        self._follower: asyncio.Task[None] | None = None
        self.gate = PriorityGate()
        self.admission = Admission(config.generation.max_active, config.generation.active_hold_s)
        #: Kakeya counters: session id -> [INV-1 violations, INV-2 violations]
        self.invariant_violations: dict[str, list[int]] = {}
        self.max_depth = config.sessions.max_nesting_depth
        self.max_nodes = config.sessions.max_nodes
        self.pipeline: PipelineLimits = config.generation

    # -- construction ------------------------------------------------------

    @classmethod
    async def create(
        cls, config: Config, *, engine: Engine | None = None, clock: Clock = time.time
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
                    if st is None or e.version <= st.version or e.session_id in self.generating:
                        continue
                    lock = self._locks.get(e.session_id)
                    if lock is None or not lock.locked():
                        self.drop(st)
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

    # -- sessions ----------------------------------------------------------

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
        await self.commit(st, [NewEvent(T.SESSION_OPENED, body)])
        self._cache(st)
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
        parent = await self.get(session_id)
        if parent.status == PURGED:
            raise SessionNotFound(session_id)
        if at_version is not None:
            if not 1 <= at_version <= parent.version:
                raise InvalidParameters(
                    f"fork version {at_version} is outside [1, {parent.version}]"
                )
            base = await self.load(session_id, at_version)
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
        await self.commit(st, [NewEvent(T.SESSION_OPENED, body)])
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
        async with self.lock(session_id):
            st = await self.get(session_id)
            if st.status != OPEN:
                return st
            if session_id in self.generating:
                raise SessionBusy(session_id)
            await self.commit(st, [NewEvent(T.SESSION_CLOSED, {"reason": reason})])
        self.engine.forget(session_id)
        metrics.SESSIONS_OPEN.dec()
        return st

    async def abort(self, session_id: str, code: str, message: str) -> SessionState:
        """Record a protocol abort (the transport ends the stream with an error).

        A running generation is stopped first (finished as ``aborted``), so
        nothing is generated after the abort.
        """
        await self.generating.stop(session_id)
        st = await self._record_abort(session_id, code, message)
        self.engine.forget(session_id)
        return st

    @stale_retry
    async def _record_abort(self, session_id: str, code: str, message: str) -> SessionState:
        async with self.lock(session_id):
            st = await self.get(session_id)
            if st.status == OPEN:
                await self.commit(
                    st, [NewEvent(T.SESSION_ABORTED, {"code": code, "message": message})]
                )
                metrics.SESSIONS_OPEN.dec()
        return st

    # -- content -----------------------------------------------------------

    @stale_retry
    async def record(self, session_id: str, new: Sequence[NewEvent]) -> list[Event]:
        """Append events that carry no model rule (wire messages, notes, feedback)
        to a session in any state but purged."""
        async with self.lock(session_id):
            st = await self.get(session_id)
            if st.status == PURGED:
                raise SessionNotFound(session_id)
            return await self.commit(st, new)

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

    def append_events(
        self,
        st: SessionState,
        tokens: Sequence[int],
        offset: int | None,
        truncating: bool,
        images: Sequence[ImageIn],
        image_blobs: list[tuple[str, int]],
    ) -> list[NewEvent]:
        """Check an append against ``st`` and build its events (no mutation)."""
        info = self.engine.info
        tokens = [int(t) for t in tokens]
        check_vocab(tokens, info.vocab_size)
        cut = rewind_point(st, offset, truncating)
        base = st.length if cut is None else cut
        new_len = base + len(tokens)
        check_length(new_len, info.max_length)
        if images:
            block = (
                None
                if info.image_block_tokens is None
                else self.engine.image_block_length(images[0].data, images[0].mime)
            )
            check_images(images, base, new_len, block, tokens, info.image_pad_token_id)
        out: list[NewEvent] = []
        if cut is not None:
            out.append(
                NewEvent(
                    T.TOKENS_TRUNCATED, tokens_truncated("rewind", [[0, cut]], st.length - cut)
                )
            )
        if tokens or images:
            imgs = [
                {"start": im.start, "end": im.end, "mime": im.mime, "sha256": sha, "size": size}
                for im, (sha, size) in zip(images, image_blobs, strict=True)
            ]
            out.append(
                NewEvent(T.TOKENS_APPENDED, {"start": base, "tokens": tokens, "images": imgs})
            )
        return out

    async def image_events(
        self, images: Sequence[ImageIn]
    ) -> tuple[list[NewEvent], list[tuple[str, int]]]:
        import hashlib

        notes, shas = [], []
        for im in images:
            sha = hashlib.sha256(im.data).hexdigest()
            shas.append((sha, len(im.data)))
            notes.append(
                NewEvent(
                    T.IMAGE_ATTACHED,
                    {"sha256": sha, "mime": im.mime, "size": len(im.data)},
                    im.data,
                )
            )
        return notes, shas

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
        async with self.lock(session_id):
            st = await self.open_locked(session_id)
            if session_id in self.generating:
                raise SessionBusy(session_id)
            notes, shas = await self.image_events(images)
            new = self.append_events(st, tokens, offset, truncating, images, shas)
            if new:
                await self.commit(st, notes + new)
            return st.length

    async def append_text(self, session_id: str, text: str) -> int:
        return await self.append_tokens(session_id, self.engine.tokenize(text))

    # -- generation --------------------------------------------------------

    async def generate(
        self,
        session_id: str,
        params: SamplingParams,
        options: OutputOptions = DEFAULT_OUTPUT,
        *,
        append: Sequence[int] = (),
        offset: int | None = None,
        truncating: bool = False,
        images: Sequence[ImageIn] = (),
        priority: int = 0,
        action_id: str | None = None,
        sink_window: tuple[int, int] | None = None,
        start_apart: bool = False,
    ) -> AsyncIterator[Event]:
        """Append (optionally), prefill and decode; yields each committed event.

        Yields ``tokens.truncated`` (a rewind, or sink+window at most once),
        ``generation.started``, ``generation.token`` per scored prompt
        position and per generated token, then ``generation.finished``. Every
        check happens before the first commit, which holds the append, any
        truncation and ``generation.started`` together, with the first run of
        tokens unless ``start_apart`` (core/generation.py). A second concurrent
        generate on the session raises SessionBusy. If the caller stops
        iterating, the generation is recorded as ``cancelled``; an engine
        failure as ``error`` with an ``error.recorded`` event. Without a seed,
        one is drawn and recorded, so every generation can be re-executed.

        The same as :meth:`generate_runs`, one event at a time.
        """
        runs = self.generate_runs(
            session_id,
            params,
            options,
            append=append,
            offset=offset,
            truncating=truncating,
            images=images,
            priority=priority,
            action_id=action_id,
            sink_window=sink_window,
            start_apart=start_apart,
        )
        try:
            async for run in runs:
                for e in run:
                    yield e
        finally:
            # abandoned without aclose, both generators are finalized by the loop at
            # once: the inner one may be closing already
            with contextlib.suppress(RuntimeError):
                await runs.aclose()  # type: ignore[attr-defined]

    def generate_runs(
        self,
        session_id: str,
        params: SamplingParams,
        options: OutputOptions = DEFAULT_OUTPUT,
        *,
        append: Sequence[int] = (),
        offset: int | None = None,
        truncating: bool = False,
        images: Sequence[ImageIn] = (),
        priority: int = 0,
        action_id: str | None = None,
        sink_window: tuple[int, int] | None = None,
        with_run: RunHook | None = None,
        start_apart: bool = False,
    ) -> AsyncIterator[list[Event]]:
        """:meth:`generate` in runs: each item is the events of one commit.

        The engine decodes ahead of the log (at most ``generation.run_ahead``
        steps) while runs commit; a transport that writes a whole run at once
        pays its per-message cost once per run (core/pipeline.py).
        ``with_run`` adds the caller's own events to each run's commit
        (:data:`~sessiontape.core.pipeline.RunHook`). ``start_apart``: the first
        item is the committed ``generation.started`` (and any truncation), before
        the engine starts; otherwise they come in the first run.
        """
        request = GenerateRequest(
            params,
            options,
            append=append,
            offset=offset,
            truncating=truncating,
            images=images,
            priority=priority,
            action_id=action_id,
            sink_window=sink_window,
            with_run=with_run,
            start_apart=start_apart,
        )
        return generate_runs(self, session_id, request)

    def record_violation(self, session_id: str, which: int) -> None:
        counts = self.invariant_violations.setdefault(session_id, [0, 0])
        counts[which - 1] += 1
        metrics.INVARIANT_VIOLATIONS.labels(f"INV-{which}").inc()

    def is_generating(self, session_id: str) -> bool:
        return session_id in self.generating

    def idle_seconds(self, session_id: str) -> float:
        st = self._states.get(session_id)
        last = self._last_active.get(session_id, st.updated_at if st else self.clock())
        return max(0.0, self.clock() - last)
