"""The token pipeline of one generation: engine steps through the log to the caller.

Three stages run at once for one generation::

    engine ──steps──▶ [run-ahead queue] ──▶ committer ──runs──▶ caller
    (producer task)    (bounded)           (one append per run) (yields a run
                                                                  after its commit)

- The **producer** task pulls steps from ``Engine.generate`` (through the
  runtime's priority gate) into a queue bounded by the run policy's ``run_ahead``:
  when commits fall behind, the queue fills and the engine waits
  (back-pressure), so memory stays bounded whatever the disk does.
- The **committer** takes every step that is ready (at least one, at most
  ``max_run``), appends them as one ``log.append`` (one
  transaction; the log's writer still groups concurrent sessions' appends
  into one commit) and starts the next append as soon as the previous one
  settled.
- The **caller** receives a run of committed events while the next run
  commits. Nothing is yielded before its commit: durable before visible.
  A caller slower than the engine (a wire that sends one message per token)
  gets runs it handles in about the policy's ``pace_s`` each, and the next run
  commits when it asks for it rather than while it handles this one: tokens
  committed ahead would only wait behind the run in hand, so on demand a run
  can be longer (fewer appends) for about the same commit-to-client latency.

When the caller stops (cancel, client gone), an abort is requested, or the
engine fails, steps that were decoded but not committed are dropped, the
producer is stopped, the engine is told to rewind its cache to the committed
history (``Engine.rewind``), and ``generation.finished`` counts exactly the
generated tokens the log holds (the fold's count, not the loop's).

How many steps a run holds, how long the committer lingers and how long a turn of the
gate lasts is the run policy's decision (:mod:`sessiontape.core.generation.policy`);
this module measures and acts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from sessiontape.core import metrics
from sessiontape.core.bodies import FinishReason, GenerationFinished
from sessiontape.core.engine.interface import Step
from sessiontape.core.errors import CacheInvariantViolation, SessiontapeError
from sessiontape.core.events import Event, NewEvent, T
from sessiontape.core.generation.host import GenerationHost
from sessiontape.core.generation.policy import (
    CONSUME_NEW_WEIGHT,
    INTERVAL_NEW_WEIGHT,
    SHORT_GENERATION,
    RunPolicy,
    ShortHold,
    moving_average,
)
from sessiontape.core.generation.request import FirstAppend, GenerateRequest
from sessiontape.core.generation.scheduler import NO_GATE
from sessiontape.core.session.state import SessionState
from sessiontape.core.tokens import fold_tokens


class _End:
    """The engine finished (or failed, when ``error`` is set)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


class TokenPipeline:
    """The token path of one running generation (made by
    :func:`sessiontape.core.generation.lifecycle.generate_runs`)."""

    def __init__(
        self,
        rt: GenerationHost,
        st: SessionState,
        gid: str,
        request: GenerateRequest,
        policy: RunPolicy,
        first: FirstAppend,
    ) -> None:
        self.rt = rt
        self._first = first
        self.with_run = request.with_run
        self.st = st
        self.gid = gid
        self.params = request.params
        self.options = request.options
        self.priority = request.priority
        self.policy = policy
        self.sid = st.session_id
        self.eos = set(st.eos_token_ids)
        self.stops = set(request.params.stop_token_ids)
        self.t0 = time.perf_counter()
        self.ttft: float | None = None
        self.prefill_s: float | None = None
        self.reason: FinishReason = "length"
        self.last_pos = -1
        self.ended = False  # no step will follow (stop token, abort, engine done)
        self.dropped = 0
        #: steps pulled from the engine
        self.taken = 0
        self._queue: asyncio.Queue[Step | _End] = asyncio.Queue(maxsize=policy.run_ahead)
        #: committed runs not yet handed to the caller (a slow caller pauses the committer)
        self._out: asyncio.Queue[list[Event] | Exception | None] = asyncio.Queue()
        #: committed runs the caller has not taken yet may be at most one: the next run
        #: commits while the caller handles this one, never further ahead (a slow client
        #: leaves steps uncommitted, where the run-ahead bound holds the engine back);
        #: none for a paced caller (:meth:`RunPolicy.paced_run`), whose next run commits on demand
        self._credit = asyncio.Semaphore(1)
        #: moving average of the time the caller spends per event of a run (None before
        #: the second run): runs are cut so one takes the caller about ``pace_s``
        self.consume_per_event: float | None = None
        self._producer: asyncio.Task[None] | None = None
        #: moving average of the time between engine steps (None before the second)
        self.interval: float | None = None
        #: set by the producer once ``_enough_at`` steps wait (the committer lingers on it)
        self._enough: asyncio.Event | None = None
        self._enough_at = 0
        #: the producer handed the gate to another generation and waits for its next
        #: turn: no step comes soon, so the committer does not linger for more
        self._off_gate = False
        #: the engine's last step (or its failure) is in the queue: nothing more will
        #: come, so the committer never lingers for more
        self._engine_done = False
        self._first_run = policy.first_run(request.params.max_tokens)
        #: a short generation's hold of the gate to its end (core/generation/policy.py)
        self._short: ShortHold | None = None
        #: the engine ended on its own and every step it made was taken: the run that
        #: carries the last of them also carries ``generation.finished`` (one commit
        #: fewer per generation; a short turn's whole answer can be one commit)
        self._natural_end = False
        #: ``generation.finished`` committed with the last run
        self.finish_committed = False

    @property
    def first_pending(self) -> bool:
        """The first append waits for its commit (the fold has no such generation yet)."""
        return bool(self._first.pending) and self.gid not in self.st.generations

    @property
    def history_length(self) -> int:
        """The history's length once what is committed so far and the first append are."""
        return self._first.length if self.first_pending else self.st.length

    def _pending(self) -> list[NewEvent]:
        return list(self._first.pending) if self.first_pending else []

    # -- stages --------------------------------------------------------------

    def start_engine(self) -> None:
        st = self.st
        history: list[int] = list(st.tokens)
        for ne in self._pending():
            fold_tokens(history, ne.type, ne.body)
        max_tokens = min(self.params.max_tokens, self.rt.engine.info.max_length - len(history))
        # open_session records the engine's ids when none were given, so an
        # empty list is a deliberate "no EOS" (Kakeya), not a missing value.
        eparams = dataclasses.replace(
            self.params, max_tokens=max_tokens, stop_token_ids=tuple(sorted(self.eos | self.stops))
        )
        self._first_run = self.policy.first_run(max_tokens)
        if max_tokens <= SHORT_GENERATION and not self.rt.engine.batches:
            self._short = ShortHold(max_tokens)
        steps = self.rt.engine.generate(self.sid, history, eparams, self.options)
        self._producer = asyncio.create_task(self._produce(steps), name=f"engine-{self.sid}")

    async def _produce(self, steps: AsyncIterator[Step]) -> None:
        """Engine steps into the run-ahead queue, a burst at a time through the gate.

        Holding the gate for up to ``burst`` steps (while nothing more urgent
        waits and the queue has room) keeps equal-priority generations
        taking turns without a hand-over per token.
        """
        policy = self.policy
        gate, q, burst, burst_s = self.rt.gate, self._queue, policy.burst, policy.burst_s
        short = self._short
        if self.rt.engine.batches:
            # the engine schedules every generation's steps into shared passes itself:
            # taking turns here would leave all but one session idle in each pass
            gate = NO_GATE
        try:
            done = False
            step: Step | None = None
            while not done:
                async with gate.slot(self.priority):
                    self._off_gate = False
                    # the interval is the engine's time per step: not the wait for the
                    # gate (other generations' bursts) or for room in the queue, which
                    # would make a fast engine look slow to the committer after each
                    # hand-over (it would commit that burst's first step as a run alone)
                    last = time.perf_counter()
                    turn_ends = last + burst_s
                    if short is not None:
                        short.begin(last)
                    for _ in range(burst):
                        try:
                            step = await anext(steps)
                        except StopAsyncIteration:
                            done = True
                            break
                        self.taken += 1
                        now = time.perf_counter()
                        if short is not None and not step.is_prefill:
                            short.decoded_one(now - last)
                        self.interval = moving_average(
                            self.interval, now - last, INTERVAL_NEW_WEIGHT
                        )
                        last = now
                        if q.full():
                            break  # wait for room outside the gate
                        q.put_nowait(step)
                        step = None
                        if self._enough is not None and q.qsize() >= self._enough_at:
                            self._enough.set()
                        if gate.more_urgent_waiting(self.priority) or policy.turn_over(
                            now, turn_ends, gate.waiting(), short
                        ):
                            break
                    handing_over = gate.waiting()
                if handing_over:
                    # the next steps come after the other generations' turns: a
                    # committer lingering for more commits this turn's steps now, and
                    # one that comes for them later does not linger
                    self._off_gate = True
                    if self._enough is not None:
                        self._enough.set()
                if not done and step is not None:
                    await q.put(step)
            await self._put_end(_End())
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._put_end(_End(exc))
        finally:
            await steps.aclose()  # type: ignore[attr-defined]

    async def _put_end(self, end: _End) -> None:
        await self._queue.put(end)
        self._engine_done = True
        if self._enough is not None:
            self._enough.set()

    async def stop_engine(self) -> None:
        """Stop the producer and drop what it decoded beyond the log."""
        task = self._producer
        if task is not None and not task.done():
            task.cancel()
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        while not self._queue.empty():
            self._queue.get_nowait()
        # steps the engine handed out that no commit carried (queued, or held by
        # the producer when it stopped): the fold counts what the log holds
        g = self.st.generations.get(self.gid)
        committed = 0 if g is None else g.scored + len(g.tokens)
        self.dropped = self.taken - committed

    async def _take(self) -> list[Step]:
        """Every ready step (waiting for the first), cut after a stop token.

        How many at most, and how long to wait for more, is the run policy's
        (:meth:`RunPolicy.run_bounds`, :meth:`RunPolicy.linger`).

        Raises what the engine raised once the steps before the failure
        were taken (and so get committed).
        """
        q = self._queue
        first = await q.get()
        interval = self.interval
        max_run, min_run = self.policy.run_bounds(
            self.consume_per_event, self._engine_done, self._first_run
        )
        # more steps come soon unless the engine ended or the producer handed the gate over
        soon = not (isinstance(first, _End) or self._off_gate or self._engine_done)
        wait = self.policy.commit_wait(
            ready=q.qsize() + 1,
            min_run=min_run,
            interval=interval,
            more_soon=soon,
            short=self._short,
            others_waiting=self.rt.gate.waiting(),
            now=time.perf_counter(),
        )
        if wait > 0:
            # a fast engine: let a few more steps arrive (woken early when enough did)
            enough = self._enough = asyncio.Event()
            self._enough_at = min_run - 1
            timer = asyncio.get_running_loop().call_later(wait, enough.set)
            try:
                await enough.wait()
            finally:
                timer.cancel()
                self._enough = None
        out: list[Step] = []
        item = first
        while True:
            if isinstance(item, _End):
                self.ended = True
                self._natural_end = item.error is None
                if item.error is not None and not out:
                    raise item.error
                if item.error is not None:
                    self._queue.put_nowait(item)  # raise it after committing what came first
                    self.ended = False
                break
            out.append(item)
            if not item.is_prefill and (item.token_id in self.eos or item.token_id in self.stops):
                self.reason = "eos" if item.token_id in self.eos else "stop"
                self.ended = True
                # the engine stops at a stop token: its end is usually queued already
                if not q.empty():
                    after = q.get_nowait()
                    self._natural_end = isinstance(after, _End) and after.error is None
                    if not isinstance(after, _End):
                        q.put_nowait(after)  # an engine that went on: stop_engine drops it
                break
            if len(out) >= max_run or q.empty():
                break
            item = q.get_nowait()
        return out

    def _events(self, steps: list[Step]) -> tuple[list[NewEvent], int]:
        gid, t0 = self.gid, self.t0
        new: list[NewEvent] = []
        generated = 0
        now = round(time.perf_counter() - t0, 6)
        for step in steps:
            if step.position <= self.last_pos:
                self.rt.record_violation(self.sid, 2)
                raise CacheInvariantViolation(
                    f"INV-2: position {step.position} after {self.last_pos} in {self.sid}"
                )
            self.last_pos = step.position
            body: dict[str, Any] = {
                "generation_id": gid,
                "token": step.token_id,
                "position": step.position,
                "is_prefill": step.is_prefill,
                "t": now,
            }
            if step.logprob is not None:
                body["logprob"] = step.logprob
            if step.top_logprobs:
                body["top"] = [[i, lp] for i, lp in step.top_logprobs]
            if step.readout is not None:
                body["readout"] = list(step.readout)
            new.append(NewEvent(T.GENERATION_TOKEN, body))
            generated += not step.is_prefill
        if generated and self.prefill_s is None:
            self.prefill_s = now
        return new, generated

    async def _commit_run(self, steps: list[Step]) -> list[Event]:
        run, generated = self._events(steps)
        rt = self.rt
        async with rt.sessions.lock(self.sid):
            # the first run carries the first append when it waits for its commit
            first = self._pending()
            new = [*first, *run]
            length = self.history_length + generated
            finish = self._finish_with_run(generated)
            # (a last run may hold no generated token: the engine's end came on its own)
            if self.with_run is not None and (generated or finish):
                tokens = [s.token_id for s in steps if not s.is_prefill]
                new.extend(self.with_run(self.st, tokens, bool(finish)))
            new.extend(finish)
            # Alone, a run commits on the spot when the writer is idle (a slow engine's
            # steps each pay no hand-offs). Beside other generations it goes through
            # the write loop, whose hand-offs let more steps gather per run (committed
            # on the spot, fast generations side by side make runs of a step or two).
            evs = await rt.sessions.commit(
                self.st, new, length=length, at_once=len(rt.running) <= 1
            )
        self.finish_committed = bool(finish)
        evs = shown(evs, len(first))
        if generated:
            metrics.TOKENS_GENERATED.inc(generated)
            if self.ttft is None:
                self.ttft = time.perf_counter() - self.t0
                metrics.TTFT_SECONDS.observe(self.ttft)
        return evs

    def _finish_with_run(self, generated: int) -> list[NewEvent]:
        """``generation.finished`` for the run being committed, when it is the last (the
        engine ended on its own, every step taken, its cache no longer than the history
        will be); empty otherwise, and the finish commits on its own after the runs."""
        if not (self.ended and self._natural_end) or self.reason == "aborted":
            return []
        length = self.history_length + generated
        cached = self.rt.engine.cached_length(self.sid)
        if cached is not None and cached > length:
            return []  # INV-1 fails: raised after the runs, recorded as an error
        if generated and self.ttft is None:
            self.ttft = time.perf_counter() - self.t0
            metrics.TTFT_SECONDS.observe(self.ttft)
        return self.finished_event(self.reason, None, generated)

    async def _commit_loop(self) -> None:
        out = self._out
        try:
            while not self.ended:
                if self.rt.running.stop_requested(self.sid):
                    self.reason = "aborted"
                    break
                await self._credit.acquire()
                steps = await self._take()
                # a cancel that lands during the commit waits for it to settle (_commit)
                out.put_nowait(await self._commit_run(steps))
            await out.put(None)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await out.put(exc)

    async def runs(self) -> AsyncIterator[list[Event]]:
        """Committed runs of ``generation.token`` events, as soon as each commits (the
        committer goes on with the next run while the caller handles this one)."""
        committer = asyncio.create_task(self._commit_loop(), name=f"committer-{self.sid}")
        try:
            while True:
                item = await self._out.get()
                # until the caller has handled a run its pace is unknown: the next run
                # waits for it, so a slow caller's second run is cut like the rest
                paced = (
                    self.consume_per_event is None
                    or self.policy.paced_run(self.consume_per_event) is not None
                )
                if not paced:
                    self._credit.release()  # the next run commits while this one is handled
                if item is None:
                    return
                if isinstance(item, Exception):
                    raise item
                given = time.perf_counter()
                yield item
                per = (time.perf_counter() - given) / max(1, len(item))
                self.consume_per_event = moving_average(
                    self.consume_per_event, per, CONSUME_NEW_WEIGHT
                )
                if paced:
                    self._credit.release()  # the caller asks for the next run: commit it now
        finally:
            if not committer.done():
                committer.cancel()
            # a commit in flight settles before anyone looks at the state
            with contextlib.suppress(BaseException):
                await committer

    async def commit_end(self, reason: FinishReason, failure: BaseException | None) -> list[Event]:
        """Commit the generation's end on its own (with the first append when that still
        waits for its commit); returns what the caller is shown of it."""
        first = self._pending()
        async with self.rt.sessions.lock(self.sid):
            # an end the last run did not carry (the engine's own end came after it): the
            # run hook's last call, with no tokens, adds its events (a reply's calls, a final
            # fragment) to this commit when the generation ended by eos, stop or length
            ended = reason in ("eos", "stop", "length") and failure is None
            last = [*self.with_run(self.st, [], True)] if ended and self.with_run else []
            evs = await self.rt.sessions.commit(
                self.st, [*first, *last, *self.finished_event(reason, failure)]
            )
        return shown(evs, len(first))

    def finished_event(
        self, reason: FinishReason, failure: BaseException | None, uncommitted: int = 0
    ) -> list[NewEvent]:
        """The events that end the generation (``uncommitted``: generated tokens of the
        run they commit with, not yet in the state)."""
        g = self.st.generations.get(self.gid)
        # before the first append commits, the generation has no tokens in the log
        prompt, produced = (
            (self._first.length, 0) if g is None else (g.prompt_length, len(g.tokens))
        )
        total = round(time.perf_counter() - self.t0, 6)
        new: list[NewEvent] = []
        if failure is not None:
            code = failure.code if isinstance(failure, SessiontapeError) else "internal"
            new.append(
                NewEvent(
                    T.ERROR,
                    {
                        "code": code,
                        "message": str(failure) or type(failure).__name__,
                        "generation_id": self.gid,
                    },
                )
            )
        new.append(
            finished(
                self.gid,
                reason,
                prompt,
                produced + uncommitted,
                self.prefill_s,
                total,
                None if self.ttft is None else round(self.ttft, 6),
                # a constrained output cut by max_tokens is not a complete match: say so
                constraint_incomplete=reason == "length" and self.params.constraint is not None,
            )
        )
        return new


#: what a caller is shown of a generation's first append: the truncation it made and
#: ``generation.started``, not the request's own tokens and images (the caller sent them)
SHOWN_OF_FIRST = (T.TOKENS_TRUNCATED, T.GENERATION_STARTED)


def shown(evs: list[Event], first: int) -> list[Event]:
    """``evs`` as the caller is shown them, when their first ``first`` are the
    generation's first append."""
    if not first:
        return evs
    return [e for e in evs[:first] if e.type in SHOWN_OF_FIRST] + evs[first:]


def finished(
    gid: str,
    reason: FinishReason,
    prompt_tokens: int,
    completion_tokens: int,
    prefill_s: float | None,
    total_s: float | None,
    ttft_s: float | None,
    *,
    constraint_incomplete: bool = False,
) -> NewEvent:
    """The one place a ``generation.finished`` event is built."""
    b: GenerationFinished = {
        "generation_id": gid,
        "finish_reason": reason,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "prefill_s": prefill_s,
        "total_s": total_s,
        "ttft_s": ttft_s,
    }
    if constraint_incomplete:
        b = {**b, "constraint_incomplete": True}
    return NewEvent(T.GENERATION_FINISHED, b)
