"""A generation from request to finish: begin, the runs, the finish, and what is left
when it stops early.

:func:`generate_runs` checks a :class:`~sessiontape.core.generation.request.GenerateRequest`,
takes the session's writer lock (one writer per session across processes),
builds the generation's first append (the request's tokens and images, any
truncation and ``generation.started``), runs the token pipeline
(:mod:`sessiontape.core.generation.pipeline`) and yields its committed runs, and ends the
generation in the log exactly once: ``generation.finished`` with the last run
when the engine ended on its own, on its own commit otherwise, or
``cancelled``/``error`` when the caller stopped or something failed. The
runtime's generation part
(:class:`~sessiontape.core.generation.generations.Generations`) is its one caller.

The first append commits with the first run of tokens (a short turn's whole
generation is then one commit), and the engine starts on the history as it will
be. Nothing of the generation is visible before that commit, so durability
before visibility holds; a generation that ends before its first run commits
(cancelled, aborted, failed) commits the first append with its end. It commits
on its own first instead (before the engine starts) when the request asks for it
(``start_apart``: a caller that records something of its own after
``generation.started``, or answers once the start is durable).

Other processes may write to the database (replicas on PostgreSQL): a commit made
on a state they moved on fails as a version conflict with nothing written. When
that commit is the first run's, nothing was shown either, so the generation is
begun again on a reloaded state (:func:`_begun_again`, at most ``STALE_RETRIES``
times); a start committed apart is begun again the same way (:func:`_open`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import time
from collections.abc import AsyncIterator, Awaitable

from sessiontape.core import metrics
from sessiontape.core.appends import append_events, image_events
from sessiontape.core.bodies import FinishReason, tokens_truncated
from sessiontape.core.errors import (
    CacheInvariantViolation,
    ConcurrencyError,
    InvalidRange,
    SessionBusy,
)
from sessiontape.core.events import Event, NewEvent, T
from sessiontape.core.generation.host import GenerationHost
from sessiontape.core.generation.pipeline import TokenPipeline, finished, shown
from sessiontape.core.generation.request import FirstAppend, GenerateRequest
from sessiontape.core.session.cache import STALE_RETRIES
from sessiontape.core.session.state import SessionState
from sessiontape.core.tokens import check_ranges, length_after, sink_window_keep


def generate_runs(
    rt: GenerationHost, session_id: str, request: GenerateRequest
) -> AsyncIterator[list[Event]]:
    """The generation's committed runs (:meth:`Generations.runs`, see there)."""
    if rt.log.shared and not request.start_apart:
        runs = _begun_again(rt, session_id, request)
    else:
        runs = _generation(rt, session_id, request)
    if rt.engine.batches:
        # the engine schedules every generation's steps into shared passes itself:
        # more sessions a pass is its speed, not a longer queue
        return runs
    return rt.admission.admitted(runs, request.priority)


async def _begun_again(
    rt: GenerationHost, session_id: str, request: GenerateRequest
) -> AsyncIterator[list[Event]]:
    """A generation on a database other processes write to: begun again on a reloaded
    state when its first run's commit, which carries the first append, finds that another
    process moved the session on (nothing was written or shown, and the engine decoded
    from a history that is no longer the session's)."""
    request = _checked(rt, request)  # one seed for every attempt
    for attempt in range(STALE_RETRIES + 1):
        shown_any = False
        runs = _generation(rt, session_id, request)
        try:
            async for run in runs:
                shown_any = True
                yield run
            return
        except ConcurrencyError:
            if shown_any or attempt == STALE_RETRIES:
                raise
            metrics.STALE_RETRIES.inc()
        finally:
            # abandoned without aclose, the loop may be finalizing the inner one already
            with contextlib.suppress(RuntimeError):
                await runs.aclose()  # type: ignore[attr-defined]


async def _generation(
    rt: GenerationHost, session_id: str, request: GenerateRequest
) -> AsyncIterator[list[Event]]:
    """One attempt at the generation, from the writer lock to its settled end."""
    request = _checked(rt, request)
    gid = "g_" + secrets.token_hex(6)
    st, first = await _open(rt, session_id, gid, request)
    gen = TokenPipeline(rt, st, gid, request, rt.policy, first)
    done = False
    failure: BaseException | None = None
    try:
        gen.start_engine()
        if first.committed:
            yield shown(first.committed, len(first.committed))
        runs = gen.runs()
        try:
            async for run in runs:
                yield run
        finally:
            await runs.aclose()  # type: ignore[attr-defined]
        await _check_engine_after(rt, gen, st)
        if not gen.finish_committed:
            fin = await gen.commit_end(gen.reason, None)
            done = True
            yield fin
        done = True
    except Exception as exc:
        failure = exc
        raise
    finally:
        try:
            await _to_the_end(_settle_unfinished(rt, gen, st, done, failure))
        finally:
            # even when cancelled again while recording the cancel
            rt.running.end(session_id)
            await _to_the_end(rt.log.unlock_session(session_id))


def _checked(rt: GenerationHost, request: GenerateRequest) -> GenerateRequest:
    """The request, checked against the engine, with the sampling it left to the model
    set as the model recommends and a seed drawn when it has none (so every
    generation can be re-executed from what ``generation.started`` records)."""
    if request.params.from_model:
        params = request.params.for_model(rt.engine.info.sampling)
        request = dataclasses.replace(request, params=params)
    request.params.check()
    if request.options.readout_ranges and rt.engine.info.readout_manifest is None:
        raise InvalidRange(f"engine {rt.engine.info.name!r} has no readouts")
    if request.params.seed is None:
        params = dataclasses.replace(request.params, seed=secrets.randbits(63))
        request = dataclasses.replace(request, params=params)
    return request


async def _open(
    rt: GenerationHost, session_id: str, gid: str, request: GenerateRequest
) -> tuple[SessionState, FirstAppend]:
    """Take the session's writer lock and build the generation's first append
    (committed when it starts apart, on a reloaded state again when another process
    moved the session on meanwhile)."""
    if session_id in rt.running:
        raise SessionBusy(session_id)
    # One writer per session across processes (replicas on one PostgreSQL): the
    # log's session lock is held until the generation ended.
    if not await rt.log.try_lock_session(session_id):
        raise SessionBusy(session_id)
    try:
        for attempt in range(STALE_RETRIES + 1):
            try:
                return await _begin(rt, session_id, gid, request)
            except ConcurrencyError:
                # another process moved the session on: nothing was written, the
                # state was dropped; begin again on a reloaded one
                if attempt == STALE_RETRIES:
                    raise
                metrics.STALE_RETRIES.inc()
        raise AssertionError("unreachable")
    except BaseException:
        await rt.log.unlock_session(session_id)
        raise


async def _check_engine_after(rt: GenerationHost, gen: TokenPipeline, st: SessionState) -> None:
    """After the runs: the engine stopped, its cache rewound to the log when it decoded
    past it, and no longer than the history (Kakeya INV-1); the generation's metrics."""
    await gen.stop_engine()
    # the history the log will hold: the first append may still wait for its commit
    length = gen.history_length
    if gen.dropped:
        rt.engine.rewind(gen.sid, length)
    cached = rt.engine.cached_length(gen.sid)
    if cached is not None and cached > length:
        rt.record_violation(gen.sid, 1)
        raise CacheInvariantViolation(f"INV-1: cache holds {cached} positions, history {length}")
    total = time.perf_counter() - gen.t0
    metrics.KV_BYTES.set(rt.engine.kv_total_bytes())
    g = st.generations.get(gen.gid)
    produced = 0 if g is None else len(g.tokens)
    if produced and total > 0:
        metrics.TOKENS_PER_SECOND.observe(produced / total)


async def _to_the_end(work: Awaitable[None]) -> None:
    """Await ``work`` to its end even if this task is cancelled meanwhile, then raise
    the cancel. A generation's last record is in the log before its caller's task
    ends: a server draining at shutdown waits for those tasks, and a plain
    ``shield`` would let a second cancel end the task while the record is still
    being written."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done() and task.cancelled():
                raise
            cancelled = True
    if cancelled:
        if not task.cancelled():
            task.exception()  # retrieved: the cancel wins
        raise asyncio.CancelledError
    task.result()


async def _begin(
    rt: GenerationHost, session_id: str, gid: str, request: GenerateRequest
) -> tuple[SessionState, FirstAppend]:
    """Check the generation against the session and build its first append (the
    optional prompt, truncations and ``generation.started``, together), committed
    here when the generation starts apart (see the module docstring).

    Other processes may write to this database (replicas on PostgreSQL): a state
    they moved on is dropped by the runtime's follower when their events arrive,
    and a commit made on a state still stale fails as a version conflict with
    nothing written (the writer checks the log's end under its position lock), so
    :func:`_open` begins again on a reloaded state. Nothing is read per turn.
    """
    async with rt.sessions.lock(session_id):
        st = await rt.sessions.open_locked(session_id)
        if session_id in rt.running:
            raise SessionBusy(session_id)
        new = _interrupted(st)
        if request.appends:
            notes, shas = image_events(request.images)
            appended = append_events(
                rt.engine,
                st,
                request.append,
                request.offset,
                request.truncating,
                request.images,
                shas,
            )
            if appended:
                new += notes + appended
        length = st.length
        for ne in new:
            length = length_after(length, ne.type, dict(ne.body))
        length = _sink_window(new, length, request.sink_window)
        limit = length + request.params.max_tokens
        check_ranges(request.options.logprob_ranges, limit, "logprobs")
        check_ranges(request.options.readout_ranges, limit, "readout")
        new.append(_started(gid, request, length))
        if request.start_apart:
            first = FirstAppend(committed=await rt.sessions.commit(st, new), length=st.length)
        else:
            first = FirstAppend(pending=new, length=length)
        rt.running.begin(session_id)
    return st, first


def _interrupted(st: SessionState) -> list[NewEvent]:
    """The end of a generation left open by a process that died (this one holds the
    session's writer lock, so nobody else runs it): the log says what happened."""
    stale = st.active_generation
    if stale is None:
        return []
    return [
        finished(stale.id, "interrupted", stale.prompt_length, len(stale.tokens), None, None, None)
    ]


def _sink_window(new: list[NewEvent], length: int, sink_window: tuple[int, int] | None) -> int:
    """Kakeya's sink+window truncation, added to ``new`` when the history passes the
    window; the history's length after it."""
    if sink_window is None:
        return length
    keep = sink_window_keep(length, *sink_window)
    if keep is None:
        return length
    dropped = length - sum(b - a for a, b in keep)
    new.append(
        NewEvent(T.TOKENS_TRUNCATED, tokens_truncated("sink_window", keep, dropped, sink_window))
    )
    return length - dropped


def _started(gid: str, request: GenerateRequest, prompt_length: int) -> NewEvent:
    options = request.options
    return NewEvent(
        T.GENERATION_STARTED,
        {
            "generation_id": gid,
            "params": request.params.to_json(),
            "prompt_length": prompt_length,
            "priority": request.priority,
            "action_id": request.action_id,
            "options": {
                "logprob_top_k": options.logprob_top_k,
                "logprob_ranges": [list(r) for r in options.logprob_ranges],
                "readout_ranges": [list(r) for r in options.readout_ranges],
                "generated_logprobs": options.generated_logprobs,
            },
        },
    )


async def _settle_unfinished(
    rt: GenerationHost,
    gen: TokenPipeline,
    st: SessionState,
    done: bool,
    failure: BaseException | None,
) -> None:
    """Stop the engine, rewind its cache to the log, and record a generation that did
    not finish: ``cancelled``, or ``error`` when something failed."""
    await gen.stop_engine()
    if done:
        return
    reason: FinishReason = (
        "error" if failure is not None else ("aborted" if gen.reason == "aborted" else "cancelled")
    )
    active = st.active_generation
    if gen.first_pending or (active is not None and active.id == gen.gid):
        # the first append, if it still waits for its commit, commits with the end
        with contextlib.suppress(Exception):
            await gen.commit_end(reason, failure)
    if gen.dropped or gen.first_pending:
        # the engine's cache back to what the log holds (without the first append
        # when even its commit with the end failed)
        with contextlib.suppress(Exception):
            rt.engine.rewind(gen.sid, st.length)
