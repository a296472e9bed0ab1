"""One OpenAI-style request in a session: start it, follow it, read it back from the log.

A turn is: the request's messages rendered by the chat template and appended
with the generation (one commit holds ``tokens.appended`` and
``generation.started``), then a ``wire.message`` (transport ``openai``) that
records the normalised request, the template and the generation's id. The
turn's id is the version of its ``generation.started``; everything an
OpenAI reply shows is a function of those events, so a reply rebuilt from
the log later (GET, a resumed stream, an audit) is the reply first sent.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from sessiontape.core.bodies import (
    GenerationFinished,
    GenerationStarted,
    GenerationToken,
    WireMessage,
    body,
    generated_token,
    generation_id_of,
)
from sessiontape.core.document.text import TextStream
from sessiontape.core.engine import OutputOptions, SamplingParams
from sessiontape.core.errors import NotFound, SessiontapeError
from sessiontape.core.events import Event, T
from sessiontape.core.runtime import Runtime
from sessiontape.transports.http.chat_template import AnyTemplate, ModelTemplate

WIRE = "openai"


@dataclass
class Turn:
    """A request and its generation, as the log has them."""

    session_id: str
    started: Event
    request: dict[str, Any]
    wire_version: int
    appended: int
    tokens: list[int] = field(default_factory=list)
    token_events: list[Event] = field(default_factory=list)
    finished: Event | None = None

    @property
    def version(self) -> int:
        return self.started.version

    @property
    def generation_id(self) -> str:
        return str(body(self.started, GenerationStarted)["generation_id"])

    @property
    def prompt_tokens(self) -> int:
        return int(body(self.started, GenerationStarted).get("prompt_length", 0))

    @property
    def seed(self) -> int | None:
        """The seed the generation ran with (the request's, or the one drawn for it), as an
        integer; the log records it as a string of digits, since it may exceed 2**53."""
        recorded = body(self.started, GenerationStarted)["params"].get("seed")
        if recorded is None:
            requested = self.request.get("seed")
            return None if requested is None else int(requested)
        return int(recorded)

    @property
    def end(self) -> int:
        """The token position right after this turn's generated tokens."""
        return self.prompt_tokens + len(self.tokens)

    @property
    def finish_reason(self) -> str | None:
        if self.finished is None:
            return None
        return str(body(self.finished, GenerationFinished).get("finish_reason"))

    def stops(self) -> list[str]:
        return [str(s) for s in self.request.get("stop", [])]

    def text(self, detokenize: Any) -> tuple[str, bool]:
        """The reply's text and whether a stop string ended it."""
        ts = TextStream(detokenize, self.stops())
        for t in self.tokens:
            ts.push(t)
        ts.finish()
        return ts.text, ts.stopped


async def load_turn(runtime: Runtime, session_id: str, version: int, api: str) -> Turn:
    """The turn whose ``generation.started`` is ``version`` of ``session_id``; NotFound
    unless an OpenAI request of kind ``api`` recorded it."""
    evs = await runtime.read_events(session_id, version)
    if not evs or evs[0].version != version or evs[0].type != T.GENERATION_STARTED:
        raise NotFound(f"no {api} response at version {version} of session {session_id!r}")
    started = evs[0]
    gid = body(started, GenerationStarted).get("generation_id")
    turn: Turn | None = None
    tokens: list[int] = []
    token_events: list[Event] = []
    finished = None
    for e in evs[1:]:
        if (
            e.type == T.WIRE
            and turn is None
            and (w := body(e, WireMessage)).get("transport") == WIRE
        ):
            payload = w.get("payload") or {}
            if payload.get("generation_id") == gid and payload.get("api") == api:
                turn = Turn(
                    session_id,
                    started,
                    dict(payload.get("request") or {}),
                    e.version,
                    int(payload.get("appended", 0)),
                )
        elif generation_id_of(e) == gid:
            if (tok := generated_token(e)) is not None:
                tokens.append(int(tok))
                token_events.append(e)
            elif e.type == T.GENERATION_FINISHED:
                finished = e
        if turn is not None and finished is not None:
            break
    if turn is None:
        raise NotFound(f"no {api} response at version {version} of session {session_id!r}")
    turn.tokens, turn.token_events, turn.finished = tokens, token_events, finished
    return turn


async def follow_runs(runtime: Runtime, turn: Turn) -> AsyncIterator[list[Event]]:
    """The turn's generated-token events, then its ``generation.finished``: from the
    log, then live (only committed events), each time all that are ready (a
    committed run of tokens together; ``generation.finished`` ends the last list)."""
    gid = turn.generation_id
    sub = runtime.subscribe_batches(turn.started.position, turn.session_id)
    try:
        async for batch in sub:
            run = []
            for e in batch:
                if generation_id_of(e) != gid:
                    continue
                if generated_token(e) is not None:
                    run.append(e)
                elif e.type == T.GENERATION_FINISHED:
                    run.append(e)
                    yield run
                    return
            if run:
                yield run
    finally:
        await sub.aclose()  # type: ignore[attr-defined]


def logprob_entry(detokenize: Any, e: Event) -> dict[str, Any]:
    """OpenAI's logprob object for a ``generation.token`` event (its token, logprob and top ids)."""

    def entry(tok: int, lp: float) -> dict[str, Any]:
        text = detokenize([tok])
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    b = body(e, GenerationToken)
    top = [entry(int(i), float(lp)) for i, lp in b.get("top", [])]
    lp = b.get("logprob", 0.0)
    return {**entry(int(b["token"]), 0.0 if lp is None else float(lp)), "top_logprobs": top}


def _retrieve(task: asyncio.Task[None]) -> None:
    # the failure is in the log (error.recorded); a waiting request re-raises it
    if not task.cancelled():
        task.exception()


class Turns:
    """Starts turns; keeps the tasks that drive their generations."""

    def __init__(
        self, runtime: Runtime, template: AnyTemplate, tasks: set[asyncio.Task[Any]]
    ) -> None:
        self.runtime = runtime
        self.template = template
        self.tasks = tasks  # the app's background set: cancelled at shutdown
        self.running: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def render(
        self,
        messages: Sequence[tuple[str, str]],
        length: int,
        after_generation: bool,
        last_token: int | None = None,
    ) -> list[int]:
        at_start, after = length == 0, after_generation and length > 0
        if isinstance(self.template, ModelTemplate):
            eos = last_token in self.runtime.engine.info.eos_token_ids
            text = self.template.render(
                messages, at_start=at_start, after_generation=after, ended_with_eos=eos
            )
        else:
            text = self.template.render(messages, at_start=at_start, after_generation=after)
        return self.runtime.engine.tokenize(text)

    async def start(
        self,
        session_id: str,
        api: str,
        messages: Sequence[tuple[str, str]],
        request: dict[str, Any],
        params: SamplingParams,
        options: OutputOptions,
        *,
        close_after: bool = False,
    ) -> Turn:
        """Render, append and start generating; returns once ``generation.started`` and the
        request's ``wire.message`` are committed. The generation runs on in a task."""
        lock = self._locks.setdefault(session_id, asyncio.Lock())
        try:
            async with lock:
                st = await self.runtime.get(session_id)
                # a fork copies its parent's generations, later ones included: ask whether
                # any of them ends exactly where the history ends
                after = any(
                    g.prompt_length + len(g.tokens) == st.length for g in st.generations.values()
                )
                last = int(st.tokens[-1]) if st.length else None
                tokens = self.render(messages, st.length, after, last)
                agen = self.runtime.generate(session_id, params, options, append=tokens)
                started = None
                try:
                    async for e in agen:
                        if e.type == T.GENERATION_STARTED:
                            started = e
                            break
                    assert started is not None
                    request = {
                        **request,
                        "stop": [*self.template.stop, *request.get("stop", [])],
                        "template": self.template.to_json(),
                    }
                    payload = {
                        "api": api,
                        "generation_id": body(started, GenerationStarted)["generation_id"],
                        "version": started.version,
                        "appended": len(tokens),
                        "request": request,
                    }
                    wire = await self.runtime.record_wire(session_id, WIRE, "in", payload)
                except BaseException:
                    await agen.aclose()  # type: ignore[attr-defined]
                    raise
        finally:
            if not lock.locked():
                self._locks.pop(session_id, None)
        turn = Turn(session_id, started, request, wire.version, len(tokens))
        task = asyncio.create_task(
            self._drive(agen, turn, close_after), name=f"openai-{session_id}"
        )
        key = (session_id, started.version)
        self.running[key] = task
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        task.add_done_callback(lambda _: self.running.pop(key, None))
        task.add_done_callback(_retrieve)
        return turn

    async def _drive(self, agen: AsyncIterator[Event], turn: Turn, close_after: bool) -> None:
        """Run the generation; a stop string ends it early (the log then says ``cancelled``,
        and the text, cut before the stop string, says why)."""
        ts = TextStream(self.runtime.engine.detokenize, turn.stops())
        try:
            async for e in agen:
                if (tok := generated_token(e)) is not None:
                    ts.push(int(tok))
                    if ts.stopped:
                        break
        finally:
            await agen.aclose()  # type: ignore[attr-defined]
            if close_after:
                with contextlib.suppress(SessiontapeError):
                    await self.runtime.close(turn.session_id, "openai: store=false")

    async def wait(self, turn: Turn) -> None:
        """Until the turn's generation ended; re-raises its failure."""
        task = self.running.get((turn.session_id, turn.version))
        if task is not None:
            await asyncio.shield(task)

    async def cancel(self, turn: Turn) -> bool:
        """Stop a running turn in this process (recorded as ``cancelled``)."""
        task = self.running.get((turn.session_id, turn.version))
        if task is None or task.done():
            return False
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        return True
