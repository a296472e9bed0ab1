"""``/v1/responses``: OpenAI's Responses API over sessions.

Each response is a turn (:mod:`sessiontape.transports.http.openai.turns`) in a session; its id
is ``resp_<session id>_<version of generation.started>``. Without
``previous_response_id`` a response opens a session; with one, it continues
that response's session when the response is the session's latest (the
engine's cached KV is reused), and otherwise forks the session at the
token right after that response (``Runtime.fork``; the original stays as it
was). Stored streams are rebuilt from the log, so ``GET ...?stream=true&
starting_after=N`` resumes any response, live or finished, with the same
sequence numbers.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from sessiontape.core import errors as E
from sessiontape.core.bodies import generated_token
from sessiontape.core.document.text import TextStream
from sessiontape.core.engine.interface import OutputOptions
from sessiontape.core.events import Event
from sessiontape.core.session.state import OPEN, SessionState
from sessiontape.transports.http.openai.bodies import ResponseCreateRequest, check_fields, parse
from sessiontape.transports.http.openai.shared import (
    Api,
    BadParam,
    Models,
    error_event,
    json_body,
    split_id,
)
from sessiontape.transports.http.openai.turns import Turn, Turns, load_turn, logprob_entry
from sessiontape.transports.http.server.json_encoding import JSONResponse

API = "responses"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def response_id(turn: Turn) -> str:
    return f"resp_{turn.session_id}_{turn.version}"


def _ends_with(st: SessionState, generation_id: str, end: int) -> bool:
    """The session is open and that generation is its last thing: its history ends where
    the generation did, so a turn continuing it goes into the session itself."""
    last = next(reversed(st.generations.values()), None)
    return st.status == OPEN and last is not None and last.id == generation_id and st.length == end


class Responses:
    def __init__(self, api: Api, models: Models, turns: Turns) -> None:
        self.runtime = api.runtime
        self.limits = api.limits
        self.models = models
        self.turns = turns
        self.template = turns.template

    def _detok(self) -> Any:
        return self.runtime.engine.detokenize

    # -- POST /v1/responses -----------------------------------------------------

    async def create(self, request: Request) -> Response:
        b = await json_body(request, self.limits)
        check_fields(b, ResponseCreateRequest)
        model = self.models.check(b)
        r = parse(ResponseCreateRequest, b)
        items = r.messages()
        instructions, prev = r.instructions, r.previous_response_id
        store, background = r.store is not False, bool(r.background)
        # the values used, as the response echoes them
        params = r.sampling(r.max_output_tokens).for_model(self.runtime.engine.info.sampling)
        top = r.top_logprobs
        req = {
            "model": model,
            "input": items,
            "instructions": instructions,
            "metadata": dict(r.metadata or {}),
            "store": store,
            "background": background,
            "stream": bool(r.stream),
            "previous_response_id": prev,
            "max_output_tokens": r.max_output_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "seed": None if r.seed is None else str(r.seed),
            "logprobs": bool(r.include),
            "top_logprobs": top or 0,
        }
        sid, forked_from = await self._session(prev)
        if forked_from is not None:
            req["forked_from"] = forked_from
        messages = ([("system", instructions)] if instructions else []) + [
            (m["role"], m["content"]) for m in items
        ]
        turn = await self.turns.start(
            sid,
            API,
            messages,
            req,
            params,
            OutputOptions(logprob_top_k=top or 0),
            close_after=not store,
            live=bool(r.stream),
        )
        if r.stream:
            return self._sse(turn, -1, cancel_on_disconnect=not background)
        if background:
            return JSONResponse(await self._json(turn, reload=False))
        with contextlib.suppress(Exception):  # a failure is in the log: the response shows "failed"
            await self.turns.wait(turn)
        # a turn whose finish its driver took is whole; any other is read back from the log
        return JSONResponse(await self._json(turn, reload=False))

    async def _session(self, prev: str | None) -> tuple[str, dict[str, Any] | None]:
        """The session this response goes into, and what it forked, if it did."""
        if prev is None:
            st = await self.runtime.open_session(
                "openai",
                label="openai responses",
                meta={"openai": API, "chat_template": self.template.to_json()},
            )
            return st.session_id, None
        if (sid := await self._continues(prev)) is not None:
            return sid, None
        pturn = await self._stored(prev, "previous_response_id")
        if pturn.finished is None and self.runtime.generations.is_running(pturn.session_id):
            raise E.SessionBusy(pturn.session_id)
        # not finished and not running here: left open by a process that stopped (the next
        # generation records it as interrupted), or running in another process (which the
        # runtime's one-writer rule refuses)
        st = await self.runtime.get(pturn.session_id)
        if _ends_with(st, pturn.generation_id, pturn.end):
            return pturn.session_id, None
        child = await self.runtime.fork(
            pturn.session_id,
            at_position=pturn.end,
            protocol="openai",
            label="openai responses (fork)",
        )
        return child.session_id, {
            "session_id": pturn.session_id,
            "token_position": pturn.end,
            "response_id": prev,
        }

    async def _continues(self, prev: str) -> str | None:
        """The session of ``prev`` when it is the latest turn this process drove there, stored,
        and the session is open with nothing after it: the request continues it, known
        without reading the turn back. None otherwise (the log then says)."""
        try:
            sid, version = split_id(prev, "resp_")
        except E.NotFound:
            return None
        latest = self.turns.latest(sid, version, API)
        if latest is None or not latest.store:
            return None
        try:
            st = await self.runtime.get(sid)
        except E.SessiontapeError:
            return None  # gone since (purged): the log's answer is the one to give
        return sid if _ends_with(st, latest.generation_id, latest.end) else None

    async def _stored(self, rid: str, param: str = "response_id") -> Turn:
        try:
            sid, version = split_id(rid, "resp_")
            turn = await load_turn(self.runtime, sid, version, API)
        except E.NotFound as exc:
            raise _NoResponse(rid, param) from exc
        if not turn.request.get("store", True):
            raise _NoResponse(rid, param)
        return turn

    # -- GET, cancel, input items -------------------------------------------------

    async def retrieve(self, request: Request) -> Response:
        turn = await self._stored(request.path_params["rid"])
        q = request.query_params
        if q.get("stream", "false").lower() in ("1", "true"):
            after = q.get("starting_after")
            if after is not None and not after.lstrip("-").isdigit():
                raise BadParam("starting_after", "starting_after must be an integer")
            return self._sse(
                turn, int(after) if after is not None else -1, cancel_on_disconnect=False
            )
        return JSONResponse(await self._json(turn, reload=False))

    async def cancel(self, request: Request) -> Response:
        turn = await self._stored(request.path_params["rid"])
        if not turn.request.get("background"):
            raise BadParam(
                "response_id", "only responses created with background=true can be cancelled"
            )
        await self.turns.cancel(turn)
        return JSONResponse(await self._json(turn))

    async def input_items(self, request: Request) -> Response:
        turn = await self._stored(request.path_params["rid"])
        q = request.query_params
        try:
            limit = int(q.get("limit", "20"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 100:
            raise BadParam("limit", "limit must be an integer in [1, 100]")
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise BadParam("order", "order must be 'asc' or 'desc'")
        rid = response_id(turn)
        items = [
            {
                "id": f"msg_{rid[5:]}_{i}",
                "type": "message",
                "role": m["role"],
                "status": "completed",
                "content": [
                    {
                        "type": "output_text" if m["role"] == "assistant" else "input_text",
                        "text": m["content"],
                    }
                ],
            }
            for i, m in enumerate(turn.request.get("input", []))
        ]
        if order == "desc":
            items.reverse()
        after = q.get("after")
        if after is not None:
            ids = [it["id"] for it in items]
            if after not in ids:
                raise BadParam("after", f"no input item {after!r} in this response")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return JSONResponse(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(items) > limit,
            }
        )

    # -- shapes -------------------------------------------------------------------

    async def _json(self, turn: Turn, *, reload: bool = True) -> dict[str, Any]:
        if reload or turn.finished is None:
            turn = await load_turn(self.runtime, turn.session_id, turn.version, API)
        return self.render(turn)

    def render(self, turn: Turn, *, snapshot: bool = False) -> dict[str, Any]:
        """The response object; ``snapshot`` gives the in-progress one a stream starts with."""
        r = turn.request
        rid = response_id(turn)
        text, stopped = turn.text(self._detok())
        status, incomplete, error = _status(turn.finish_reason, stopped)
        if snapshot:
            status, incomplete, error = "in_progress", None, None
        item_status = {"completed": "completed", "in_progress": "in_progress"}.get(
            status, "incomplete"
        )
        output = (
            []
            if snapshot
            else [
                {
                    "type": "message",
                    "id": "msg_" + rid[5:],
                    "status": item_status,
                    "role": "assistant",
                    "content": [
                        {
                            "type": "output_text",
                            "text": text,
                            "annotations": [],
                            "logprobs": self._logprobs(turn, turn.token_events),
                        }
                    ],
                }
            ]
        )
        usage = None
        if not snapshot and turn.finished is not None:
            cached = max(0, turn.prompt_tokens - turn.appended)
            usage = {
                "input_tokens": turn.prompt_tokens,
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": len(turn.tokens),
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": turn.prompt_tokens + len(turn.tokens),
            }
        return {
            "id": rid,
            "object": "response",
            "created_at": int(turn.started.recorded_at),
            "status": status,
            "background": bool(r.get("background")),
            "error": error,
            "incomplete_details": incomplete,
            "instructions": r.get("instructions"),
            "max_output_tokens": r.get("max_output_tokens"),
            "model": r.get("model"),
            "output": output,
            "parallel_tool_calls": False,
            "previous_response_id": r.get("previous_response_id"),
            "reasoning": {"effort": None, "summary": None},
            "store": bool(r.get("store", True)),
            "temperature": r.get("temperature"),
            "text": {"format": {"type": "text"}},
            "tool_choice": "none",
            "tools": [],
            "top_p": r.get("top_p"),
            "top_logprobs": r.get("top_logprobs", 0),
            "truncation": "disabled",
            "usage": usage,
            "user": None,
            "metadata": r.get("metadata") or {},
            "completed_at": None
            if snapshot or turn.finished is None
            else int(turn.finished.recorded_at),
            # extensions: where the response lives in the log
            "session_id": turn.session_id,
            "seed": turn.seed,
        }

    def _logprobs(self, turn: Turn, events: list[Event]) -> list[dict[str, Any]]:
        if not turn.request.get("logprobs"):
            return []
        detok = self._detok()
        return [logprob_entry(detok, e) for e in events]

    def _sse(self, turn: Turn, starting_after: int, *, cancel_on_disconnect: bool) -> Response:
        async def body() -> AsyncIterator[bytes]:
            done = False
            last = -1
            try:
                # the events that are ready together (a committed run's deltas) go out
                # in one write
                async for ready in self.events(turn):
                    frames = []
                    for seq, event in ready:
                        last = seq
                        if seq > starting_after:
                            frames.append(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n")
                    if frames:
                        yield "".join(frames).encode()
                done = True
            except Exception as exc:
                done = True
                # OpenAI's error event: its type is "error" (the error's own type is not a field)
                error = {**error_event(exc), "type": "error", "sequence_number": last + 1}
                yield f"event: error\ndata: {json.dumps(error)}\n\n".encode()
            finally:
                if cancel_on_disconnect and not done:  # the client went away mid-stream
                    await self.turns.cancel(turn)

        return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)

    async def events(self, turn: Turn) -> AsyncIterator[list[tuple[int, dict[str, Any]]]]:
        """The response's event stream, numbered, a list at a time (the events ready
        together: a committed run's deltas); the events are a function of the log
        alone, how they are grouped is not."""
        out = _Events("msg_" + response_id(turn)[5:], TextStream(self._detok(), turn.stops()))
        yield self._opening(turn, out)
        async for run in self.turns.runs(turn):
            ready = self._deltas(turn, out, run)
            if ready:
                yield ready
        yield await self._closing(turn, out)

    def _opening(self, turn: Turn, out: _Events) -> list[tuple[int, dict[str, Any]]]:
        """The events before any text: the response created and in progress, its message
        item and the item's (empty) text part added."""
        snap = self.render(turn, snapshot=True)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item = {
            "type": "message",
            "id": out.item_id,
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        return [
            out.event("response.created", response=snap),
            out.event("response.in_progress", response=snap),
            out.event("response.output_item.added", output_index=0, item=item),
            out.part_event("response.content_part.added", part=part),
        ]

    def _deltas(
        self, turn: Turn, out: _Events, run: list[Event]
    ) -> list[tuple[int, dict[str, Any]]]:
        """A committed run's text deltas (tokens past a stop string add none)."""
        ready = []
        for e in run:
            if (tok := generated_token(e)) is not None and not out.text.stopped:
                out.behind.append(e)
                delta = out.text.push(int(tok))
                if delta:
                    ready.append(self._delta(turn, out, delta))
        return ready

    def _delta(self, turn: Turn, out: _Events, delta: str) -> tuple[int, dict[str, Any]]:
        """A text delta carrying the logprobs of the tokens behind it, which it brings out."""
        event = out.part_event(
            "response.output_text.delta", delta=delta, logprobs=self._logprobs(turn, out.behind)
        )
        out.behind = []
        return event

    async def _closing(self, turn: Turn, out: _Events) -> list[tuple[int, dict[str, Any]]]:
        """The events after the generation: the last delta, the text, part and item done, and
        the response completed, incomplete or failed (as the stored response says)."""
        ready = []
        delta = out.text.finish()
        # tokens with no text of their own (EOS) still carry a logprob: the last delta brings it
        if delta or (out.behind and turn.request.get("logprobs")):
            ready.append(self._delta(turn, out, delta))
        final = await self._json(turn)
        content = final["output"][0]["content"][0]
        terminal = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            final["status"], "response.failed"
        )
        return [
            *ready,
            out.part_event(
                "response.output_text.done", text=out.text.text, logprobs=content["logprobs"]
            ),
            out.part_event("response.content_part.done", part=content),
            out.event("response.output_item.done", output_index=0, item=final["output"][0]),
            out.event(terminal, response=final),
        ]


@dataclass
class _Events:
    """One response's stream in the making: its events numbered from 0, the text decoded so
    far, and the token events whose text has not gone out yet."""

    item_id: str
    text: TextStream
    behind: list[Event] = field(default_factory=list)
    seq: int = -1

    def event(self, type_: str, **fields: Any) -> tuple[int, dict[str, Any]]:
        """The next event, numbered."""
        self.seq += 1
        return self.seq, {"type": type_, "sequence_number": self.seq, **fields}

    def part_event(self, type_: str, **fields: Any) -> tuple[int, dict[str, Any]]:
        """The next event about the text part of the response's one message item."""
        return self.event(type_, item_id=self.item_id, output_index=0, content_index=0, **fields)


class _NoResponse(E.NotFound):
    code = "response_not_found"

    def __init__(self, rid: str, param: str) -> None:
        super().__init__(f"Response with id {rid!r} not found.")
        self.param = param


def _status(
    reason: str | None, stopped: bool
) -> tuple[str, dict[str, Any] | None, dict[str, Any] | None]:
    """(status, incomplete_details, error) for a generation's finish reason."""
    if reason is None:
        return "in_progress", None, None
    if stopped or reason in ("eos", "stop"):
        return "completed", None, None
    if reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}, None
    if reason in ("cancelled", "aborted"):
        return "cancelled", None, None
    return "failed", None, {"code": "server_error", "message": f"the generation ended: {reason}"}
