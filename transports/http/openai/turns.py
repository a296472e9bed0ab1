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
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
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
from sessiontape.core.engine.interface import OutputOptions, SamplingParams
from sessiontape.core.errors import NotFound, SessiontapeError
from sessiontape.core.events import Event, NewEvent, T
from sessiontape.core.generation.request import GenerateRequest
from sessiontape.core.runtime import Runtime
from sessiontape.core.tools import (
    CallFormat,
    CallRecorder,
    Tool,
    ToolCall,
    ToolUse,
    prompt_messages,
    use_of,
)
from sessiontape.transports.http.openai.chat_template import (
    AnyTemplate,
    Message,
    ModelTemplate,
    as_dict,
)
from sessiontape.transports.http.openai.tools import supplied_events

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
    #: the runs as this process's driving task takes them, for the stream that started
    #: the turn (None: the stream follows the log)
    live: LiveRuns | None = field(default=None, repr=False)

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
    evs = await runtime.reads.read_events(session_id, version)
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


async def follow_runs(
    runtime: Runtime, turn: Turn, after_version: int = 0
) -> AsyncIterator[list[Event]]:
    """The turn's generated-token events, then its ``generation.finished``: from the
    log, then live (only committed events), each time all that are ready (a
    committed run of tokens together; ``generation.finished`` ends the last list).
    ``after_version`` leaves out the events up to that session version."""
    gid = turn.generation_id
    sub = runtime.reads.subscribe_batches(turn.started.position, turn.session_id)
    try:
        async for batch in sub:
            run = _of_turn(batch, gid, after_version)
            if run:
                yield run
                if run[-1].type == T.GENERATION_FINISHED:
                    return
    finally:
        await sub.aclose()  # type: ignore[attr-defined]


def _of_turn(batch: Sequence[Event], gid: str, after_version: int = 0) -> list[Event]:
    """``batch``'s generated tokens of generation ``gid`` past ``after_version``, up to and
    with its ``generation.finished``."""
    run = []
    for e in batch:
        if e.version <= after_version or generation_id_of(e) != gid:
            continue
        if generated_token(e) is not None:
            run.append(e)
        elif e.type == T.GENERATION_FINISHED:
            run.append(e)
            break
    return run


class LiveRuns:
    """A turn's committed runs handed from its driving task to the stream that started it.

    The driver waits in :meth:`put` until the stream has taken the run, so the
    token pipeline sees the stream's pace ([pacing](docs/architecture.md#pacing))
    rather than the driver's: a stream that keeps up gets short runs at once, a
    slower one fewer, longer runs. When the stream stops reading (it ended, or
    took nothing for ``stalled_s``) the channel closes and the driver goes on
    alone; a stream that is still there then follows the log from its last run.
    Every run was committed before it is handed on.
    """

    #: seconds the driver waits for the stream to take a run before it goes on alone
    stalled_s = 10.0

    def __init__(self) -> None:
        # at most one run waits: put() returns only once the stream took it
        self._run: list[Event] | None = None
        self._ready = asyncio.Event()  # a run, the end or the close, for the stream
        self._taken = asyncio.Event()  # the stream took the last run (or the channel closed)
        self._ended = False
        self.closed = False

    async def put(self, run: list[Event]) -> None:
        if self.closed:
            return
        self._run = run
        self._ready.set()
        self._taken.clear()
        try:
            await asyncio.wait_for(self._taken.wait(), self.stalled_s)
        except TimeoutError:
            self.close()

    def end(self) -> None:
        """The driver is done: the stream takes what is left, then ends."""
        self._ended = True
        self._ready.set()

    def close(self) -> None:
        """No more hand-overs: the driver no longer waits, the stream stops taking."""
        self.closed = True
        self._run = None
        self._taken.set()
        self._ready.set()

    async def stream(self) -> AsyncGenerator[list[Event], None]:
        """The runs in order, until the driver ended or the channel closed."""
        try:
            while not self.closed:
                if self._run is not None:
                    run, self._run = self._run, None
                    self._taken.set()
                    yield run
                elif self._ended:
                    return
                else:
                    self._ready.clear()
                    await self._ready.wait()
        finally:
            self.close()


def logprob_entry(detokenize: Any, e: Event) -> dict[str, Any]:
    """OpenAI's logprob object for a ``generation.token`` event (its token, logprob and top ids)."""

    def entry(tok: int, lp: float) -> dict[str, Any]:
        text = detokenize([tok])
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    b = body(e, GenerationToken)
    top = [entry(int(i), float(lp)) for i, lp in b.get("top", [])]
    lp = b.get("logprob", 0.0)
    return {**entry(int(b["token"]), 0.0 if lp is None else float(lp)), "top_logprobs": top}


def tool_use_of(turn: Turn) -> dict[str, Any] | None:
    """The tools a turn's request let the model call (None: none, or ``tool_choice`` none)."""
    use = turn.request.get("tool_use")
    return use if use and use.get("tool_choice") != "none" else None


def turn_calls(turn: Turn, text: str) -> list[ToolCall]:
    """The calls a turn's reply made (none when its request had no tools to call)."""
    use = tool_use_of(turn)
    if use is None:
        return []
    fmt = CallFormat(**use.get("call_format", {}))
    return fmt.parse(text, turn.generation_id)


def _retrieve(task: asyncio.Task[None]) -> None:
    # the failure is in the log (error.recorded); a waiting request re-raises it
    if not task.cancelled():
        task.exception()


@dataclass(frozen=True)
class Latest:
    """A session's latest turn that this process drove to its committed finish: what a
    request continuing it (``previous_response_id``) needs to know, without reading the
    turn back from the log."""

    version: int
    api: str
    generation_id: str
    end: int
    store: bool


class Turns:
    """Starts turns; keeps the tasks that drive their generations."""

    #: sessions whose latest driven turn is remembered (:class:`Latest`, about 100 bytes)
    LATEST_KEPT = 65_536

    def __init__(
        self, runtime: Runtime, template: AnyTemplate, tasks: set[asyncio.Task[Any]]
    ) -> None:
        self.runtime = runtime
        self.template = template
        self.tasks = tasks  # the app's background set: cancelled at shutdown
        self.running: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._latest: OrderedDict[str, Latest] = OrderedDict()

    def latest(self, session_id: str, version: int, api: str) -> Latest | None:
        """The session's latest turn driven here, if it is the one at ``version`` of ``api``.
        A hint only: the caller checks against the session's state that nothing followed
        it (a later append or generation, a close, a purge) before it relies on it."""
        got = self._latest.get(session_id)
        return got if got is not None and got.version == version and got.api == api else None

    def _remember(self, turn: Turn, api: str) -> None:
        self._latest[turn.session_id] = Latest(
            turn.version, api, turn.generation_id, turn.end, bool(turn.request.get("store", True))
        )
        self._latest.move_to_end(turn.session_id)
        while len(self._latest) > self.LATEST_KEPT:
            self._latest.popitem(last=False)

    def render(
        self,
        messages: Sequence[Message],
        length: int,
        after_generation: bool,
        last_token: int | None = None,
        use: ToolUse | None = None,
    ) -> list[int]:
        at_start, after = length == 0, after_generation and length > 0
        messages = prompt_messages([as_dict(m) for m in messages], use, self.call_format, at_start)
        if isinstance(self.template, ModelTemplate):
            eos = last_token in self.runtime.engine.info.eos_token_ids
            text = self.template.render(
                messages,
                at_start=at_start,
                after_generation=after,
                ended_with_eos=eos,
                tools=None if use is None else use.template_tools(),
            )
        else:
            text = self.template.render(messages, at_start=at_start, after_generation=after)
        return self.runtime.engine.tokenize(text)

    @property
    def template_source(self) -> str | None:
        """The served model's Jinja template source (None for a role-marker template)."""
        return self.template.source if isinstance(self.template, ModelTemplate) else None

    @property
    def call_format(self) -> CallFormat:
        return CallFormat.for_template(self.template_source)

    def tool_use(self, tools: Sequence[Tool], choice: str, parallel: bool) -> ToolUse | None:
        """How a request with ``tools`` lets the model call them (None without tools)."""
        if not tools and choice == "none":
            return None
        return use_of(tools, choice, parallel, self.template_source)

    async def start(
        self,
        session_id: str,
        api: str,
        messages: Sequence[Message],
        request: dict[str, Any],
        params: SamplingParams,
        options: OutputOptions,
        *,
        close_after: bool = False,
        live: bool = False,
        use: ToolUse | None = None,
    ) -> Turn:
        """Render, append and start generating; returns once ``generation.started`` and the
        request's ``wire.message`` are committed. The generation runs on in a task; with
        ``live``, its runs are handed to the caller's stream (:meth:`runs`) as they commit.

        ``use``: the request's tools; the calls and results its messages bring are recorded
        first (``supplied_by: "client"``), and the calls the model makes commit with its
        generation's finish (:mod:`sessiontape.core.tools`)."""
        given = [as_dict(m) for m in messages]
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
                tokens = self.render(given, st.length, after, last, use)
                calls = CallRecorder(self.runtime.engine.detokenize, use)
                # started apart: the request's wire.message follows generation.started
                runs = self.runtime.generate_runs(
                    session_id,
                    GenerateRequest(
                        params,
                        options,
                        append=tokens,
                        start_apart=True,
                        with_run=calls if calls.wanted else None,
                    ),
                )
                try:
                    # the first run: any truncation and generation.started
                    first = await anext(aiter(runs))
                    [started] = [e for e in first if e.type == T.GENERATION_STARTED]
                    sb = body(started, GenerationStarted)
                    calls.started(str(sb["generation_id"]), int(sb["prompt_length"]))
                    request, wire = await self._record_request(
                        started, api, request, len(tokens), given, use
                    )
                except BaseException:
                    await runs.aclose()  # type: ignore[attr-defined]
                    raise
        finally:
            if not lock.locked():
                self._locks.pop(session_id, None)
        turn = Turn(session_id, started, request, wire.version, len(tokens))
        turn.live = LiveRuns() if live else None
        task = asyncio.create_task(
            self._drive(runs, turn, api, close_after), name=f"openai-{session_id}"
        )
        key = (session_id, started.version)
        self.running[key] = task
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        task.add_done_callback(lambda _: self.running.pop(key, None))
        task.add_done_callback(_retrieve)
        return turn

    async def _record_request(
        self,
        started: Event,
        api: str,
        request: dict[str, Any],
        appended: int,
        messages: Sequence[Mapping[str, Any]],
        use: ToolUse | None,
    ) -> tuple[dict[str, Any], Event]:
        """Record the request (``wire.message``) after its generation's start, with the tool
        calls and results its messages bring, in one commit; the request as recorded."""
        request = {
            **request,
            "stop": [*self.template.stop, *request.get("stop", [])],
            "template": self.template.to_json(),
        }
        if use is not None:
            request["tool_use"] = use.to_json()
        payload = {
            "api": api,
            "generation_id": body(started, GenerationStarted)["generation_id"],
            "version": started.version,
            "appended": appended,
            "request": request,
        }
        wire = NewEvent(T.WIRE, {"transport": WIRE, "direction": "in", "payload": payload})
        evs = await self.runtime.record(started.session_id, [*supplied_events(messages), wire])
        return request, evs[-1]

    async def _drive(
        self, runs: AsyncIterator[list[Event]], turn: Turn, api: str, close_after: bool
    ) -> None:
        """Run the generation, handing its runs to a live stream; a stop string ends it
        early (the log then says ``cancelled``, and the text, cut before the stop string,
        says why). A generation whose ``generation.finished`` came in its runs completes
        ``turn`` from them: the same events :func:`load_turn` would read back, so the
        answer needs no read of the log."""
        stops = turn.stops()
        ts = TextStream(self.runtime.engine.detokenize, stops)
        gid = turn.generation_id
        tokens: list[int] = []
        token_events: list[Event] = []
        try:
            async for run in runs:
                if stops:  # the text is decoded here only to find a stop string
                    ts.extend([int(t) for e in run if (t := generated_token(e)) is not None])
                for e in _of_turn(run, gid):
                    if e.type == T.GENERATION_FINISHED:
                        turn.tokens, turn.token_events, turn.finished = tokens, token_events, e
                        self._remember(turn, api)
                    else:
                        tokens.append(int(generated_token(e)))  # type: ignore[arg-type]
                        token_events.append(e)
                if turn.live is not None:
                    await turn.live.put(run)
                if ts.stopped:
                    break
        finally:
            if turn.live is not None:
                turn.live.end()
            await runs.aclose()  # type: ignore[attr-defined]
            if close_after:
                with contextlib.suppress(SessiontapeError):
                    await self.runtime.close(turn.session_id, "openai: store=false")

    async def runs(self, turn: Turn) -> AsyncIterator[list[Event]]:
        """The turn's generated tokens, then its ``generation.finished`` (as
        :func:`follow_runs`): handed on by the driving task while it runs when the turn
        was started ``live``, the rest from the log (a cancel, a failure, a stop string:
        the driver ends before the finish is committed)."""
        gid, seen = turn.generation_id, turn.started.version
        if turn.live is not None:
            async with contextlib.aclosing(turn.live.stream()) as live:
                async for batch in live:
                    run = _of_turn(batch, gid, seen)
                    if run:
                        seen = run[-1].version
                        yield run
                        if run[-1].type == T.GENERATION_FINISHED:
                            return
        async for run in follow_runs(self.runtime, turn, seen):
            yield run

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
