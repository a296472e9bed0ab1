"""Streaming a D4 call's answer: generate within the price caps, send partial results, then the final one.

Partial results (``partial: true``) go out every ``stream_every_tokens``
tokens or ``stream_every_ms``, at least ``stream_gap_ms`` apart, each
published while the generation goes on (never two at once: a slow relay gets
fewer, longer ones); the final result
follows the last of them and says ``more_results`` when
the answer stopped at its length budget and the model has room, so the
caller can continue it with a funded call.

:func:`stream_answer` goes through the steps in order: plan the answer
(:func:`plan_answer`: its prompt, what a resumed call already charged, how
many tokens the caps allow), generate it (:func:`generate_answer`, with
:class:`PartialResults` publishing as it goes), recount it from the log when a
stop string ended it, and send the final result (:func:`send_final`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from sessiontape.core.bodies import GenerationFinished, generated_token
from sessiontape.core.bodies import body as typed_body
from sessiontape.core.document.text import TextStream
from sessiontape.core.errors import InvalidParameters
from sessiontape.core.events import Event, T
from sessiontape.core.generation.request import GenerateRequest
from sessiontape.core.runtime import Runtime
from sessiontape.core.session.state import SessionState
from sessiontape.engines.models.jinja_template import prompt_text
from sessiontape.transports.nostr import d4
from sessiontape.transports.nostr.settings import Settings


class Answerer(Protocol):
    """What answering a call needs of the worker (:class:`~sessiontape.transports.nostr.worker.D4Worker`'s public side)."""

    runtime: Runtime
    settings: Settings
    stats: Counter[str]

    async def send(
        self,
        sid: str,
        content: str,
        tags: list[list[str]],
        *,
        kind: int = 1,
        call_id: str | None = None,
        final: bool = False,
        caller: str = "",
        more_results: bool = False,
        close: str | None = None,
    ) -> str: ...


@dataclass(frozen=True)
class CallToAnswer:
    """A parsed D4 call, with the session it runs in and the tags its results carry."""

    sid: str
    call_id: str
    caller: str
    call: d4.Call
    tags: list[list[str]]


@dataclass
class Answer:
    """The answer as it grows: its tokens, its text (cut before a stop string) and what it has cost.

    The text is decoded as the answer grows and is a pure function of its
    tokens: a resumed call's text is the uninterrupted one's.
    """

    state: SessionState
    append: list[int]  # the prompt's tokens, when the call opens the session
    start: int  # where the answer begins in the session's tokens
    tokens: list[int]
    produced: int  # tokens generated for the call, a resumed call's earlier ones included
    planned: int  # tokens this call may still generate
    text: TextStream
    model: str
    completion_id: str
    created: int = field(default_factory=lambda: int(time.time()))
    finish: str | None = None

    def body(self, reason: str | None) -> dict[str, Any]:
        """The chat completion the answer is so far, finished with ``reason`` (None: not yet)."""
        return d4.completion(
            completion_id=self.completion_id,
            model=self.model,
            created=self.created,
            text=self.text.text,
            finish_reason=reason,
            prompt_tokens=self.start,
            completion_tokens=len(self.tokens),
        )

    def push(self, token: int) -> bool:
        """Take a generated token; True when it completed a stop string (the answer ends there)."""
        self.produced += 1
        self.tokens.append(token)
        self.text.push(token)
        if self.text.stopped:
            self.finish = "stop"
        return self.text.stopped

    def note_event(self, e: Event) -> None:
        """Take the finish reason from a ``generation.finished`` event; other events change nothing."""
        if e.type == T.GENERATION_FINISHED:
            reason = typed_body(e, GenerationFinished)["finish_reason"]
            self.finish = "stop" if reason in ("eos", "stop") else "length"

    def recount(self, state: SessionState, call_id: str) -> None:
        """Count, and charge, the answer as ``state`` (the log) holds it; the text still ends at the stop."""
        self.state = state
        self.tokens = list(state.tokens[self.start :])
        self.produced = charged_tokens(state, call_id)


def charged_tokens(state: SessionState, call_id: str) -> int:
    """Tokens the session's generations for ``call_id`` hold, each one charged."""
    return sum(len(g.tokens) for g in state.generations.values() if g.action_id == call_id)


async def plan_answer(worker: Answerer, job: CallToAnswer) -> Answer:
    """Open the answer: the prompt when the call opens the session, what is charged already, the token budget."""
    rt, settings, args = worker.runtime, worker.settings, job.call.args
    price = settings.price_msat
    st = await rt.get(job.sid)
    append: list[int] = []
    if st.length == 0:
        if args.prompt is None:
            raise InvalidParameters("args.prompt is required")
        append = rt.engine.tokenize(prompt_text(rt.engine.info.chat, args.prompt))
    gens = list(st.generations.values())
    start = gens[0].prompt_length if gens else st.length + len(append)
    # a call resumed after a restart has already charged for these
    charged = charged_tokens(st, job.call_id)
    wanted = (args.max_tokens or settings.default_max_tokens) - charged
    n, _budget_limited = d4.plan_tokens(
        price, job.call.max_total_cost - charged * price, max(0, wanted)
    )
    answer = Answer(
        state=st,
        append=append,
        start=start,
        tokens=list(st.tokens[start:]),
        produced=charged,
        planned=n,
        text=TextStream(rt.engine.detokenize, args.stop),
        model=rt.engine.info.model_id,
        completion_id="chatcmpl-" + job.call_id[:32],
    )
    answer.text.extend(answer.tokens)
    answer.finish = "stop" if answer.text.stopped else None
    return answer


class PartialResults:
    """The answer's partial results, each signed, recorded and published by a task of its own.

    The generation never waits for a relay; the next partial result is due
    only once the last one is out (a slow relay gets fewer, longer ones), and
    the final result after it.
    """

    def __init__(self, worker: Answerer, job: CallToAnswer, answer: Answer) -> None:
        self.worker, self.job, self.answer = worker, job, answer
        self.every_n = worker.settings.stream_every_tokens
        self.every_s = worker.settings.stream_every_ms / 1000
        self.gap_s = worker.settings.stream_gap_ms / 1000
        self.last_n, self.last_t = answer.produced, time.monotonic()
        self.task: asyncio.Task[str] | None = None

    def due(self) -> bool:
        """Whether the last partial result is out and enough tokens or time have passed
        since it, and at least the gap: a relay that answers in a millisecond would
        otherwise get a partial result (the whole answer so far, signed and recorded)
        every ``every_n`` tokens of a fast engine, which then runs at a fraction of its pace."""
        if self.task is not None and not self.task.done():
            return False
        since = time.monotonic() - self.last_t
        if since < self.gap_s:
            return False
        return self.answer.produced - self.last_n >= self.every_n or since >= self.every_s

    def send_if_due(self) -> None:
        """Start publishing the answer so far when a partial result is due."""
        if not self.due():
            return
        if self.task is not None:
            self.task.result()  # a partial result that failed fails the answer
        self.last_n, self.last_t = self.answer.produced, time.monotonic()
        price = self.worker.settings.price_msat
        content = d4.result_content(
            result=self.answer.body(None),
            iteration_cost=price,
            total_cost=self.answer.produced * price,
            more_results=True,
            partial=True,
        )
        job = self.job
        self.task = asyncio.create_task(
            self.worker.send(job.sid, content, job.tags, call_id=job.call_id, caller=job.caller),
            name=f"d4-partial-{job.call_id[:12]}",
        )

    async def wait(self) -> None:
        """Wait for the last partial result to be out (its failure fails the answer)."""
        if self.task is not None:
            await self.task

    async def cancel(self) -> None:
        """Cancel a partial result still being published (the answer failed or was cancelled)."""
        if self.task is not None and not self.task.done():
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task


async def generate_answer(worker: Answerer, job: CallToAnswer, answer: Answer) -> None:
    """Generate the answer's planned tokens, publishing partial results as they fall due."""
    args = job.call.args
    params = args.sampling(answer.planned)
    partials = PartialResults(worker, job, answer)
    gen = cast(
        AsyncGenerator[Event, None],
        worker.runtime.generate(
            job.sid, GenerateRequest(params, append=answer.append, action_id=job.call_id)
        ),
    )
    try:
        async with contextlib.aclosing(gen):
            async for e in gen:
                tok = generated_token(e)
                if tok is None:
                    answer.note_event(e)
                elif answer.push(int(tok)):
                    break
                else:
                    partials.send_if_due()
        await partials.wait()
    finally:
        await partials.cancel()


async def send_final(worker: Answerer, job: CallToAnswer, answer: Answer) -> None:
    """Send the final result: the whole answer, its cost, and whether the caller may continue it."""
    price = worker.settings.price_msat
    room = answer.state.length < worker.runtime.engine.info.max_length
    more = answer.finish == "length" and room
    content = d4.result_content(
        result=answer.body(answer.finish),
        iteration_cost=price,
        total_cost=answer.produced * price,
        more_results=more,
    )
    worker.stats["answered"] += 1
    await worker.send(
        job.sid,
        content,
        job.tags,
        call_id=job.call_id,
        final=True,
        caller=job.caller,
        more_results=more,
        close=None if more else "complete",
    )


async def stream_answer(worker: Answerer, job: CallToAnswer) -> None:
    """Answer ``job.call`` in session ``job.sid``: partial results while generating, then the final result."""
    answer = await plan_answer(worker, job)
    if answer.planned > 0 and answer.finish is None:
        await generate_answer(worker, job, answer)
    if answer.finish is None:
        answer.finish = "length"
    answer.text.finish()
    if answer.finish == "stop" and answer.planned > 0:
        # The generation may have committed tokens past the stop string before the
        # answer read it (it runs ahead of its reader): the answer counts, and charges,
        # what the log holds, as a resumed call does.
        answer.recount(await worker.runtime.get(job.sid), job.call_id)
    await send_final(worker, job, answer)
