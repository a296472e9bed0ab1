"""``/v1/chat/completions``: OpenAI's Chat Completions API over sessions.

Each call is a turn (:mod:`sessiontape.transports.http.openai.turns`) in a new session, so it
can be audited, replayed and exported; its id is
``chatcmpl-<session id>_<version of generation.started>``, and every reply
carries the session's id as the extension field ``session_id``. A request
that names a ``session_id`` continues that session: only the new messages
are sent, rendered after what the session holds (its cached KV is reused).
``n`` must be 1; ``stop`` strings end the reply early (the text stops
before them).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from sessiontape.core import errors as E
from sessiontape.core.bodies import GenerationFinished, generated_token
from sessiontape.core.bodies import body as typed_body
from sessiontape.core.document.text import TextStream
from sessiontape.core.engine.interface import OutputOptions
from sessiontape.core.events import Event, T
from sessiontape.core.tools import ToolCall
from sessiontape.transports.http.openai.bodies import ChatCompletionRequest, check_fields, parse
from sessiontape.transports.http.openai.shared import Api, Models, error_event, json_body
from sessiontape.transports.http.openai.turns import (
    Turn,
    Turns,
    load_turn,
    logprob_entry,
    tool_use_of,
    turn_calls,
)
from sessiontape.transports.http.server.json_encoding import JSONResponse

API = "chat.completions"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def completion_id(turn: Turn) -> str:
    return f"chatcmpl-{turn.session_id}_{turn.version}"


class ChatCompletions:
    def __init__(self, api: Api, models: Models, turns: Turns) -> None:
        self.runtime = api.runtime
        self.limits = api.limits
        self.models = models
        self.turns = turns

    def _detok(self) -> Any:
        return self.runtime.engine.detokenize

    async def create(self, request: Request) -> Response:
        b = await json_body(request, self.limits)
        check_fields(b, ChatCompletionRequest)
        model = self.models.check(b)
        r = parse(ChatCompletionRequest, b)
        messages = r.turn()
        max_tokens = r.max_tokens if r.max_completion_tokens is None else r.max_completion_tokens
        params = r.sampling(max_tokens).for_model(self.runtime.engine.info.sampling)
        use = self.turns.tool_use(r.tool_list(), r.choice(), r.parallel_tool_calls is not False)
        constraint = use.constraint() if use is not None else None
        if constraint is None and r.response_format is not None:
            constraint = r.response_format.constraint()
        if constraint is not None:
            constraint.check()
            params = dataclasses.replace(params, constraint=constraint)
        top = r.top_logprobs
        sid = r.session_id
        req = {
            "model": model,
            "messages": messages,
            "stop": r.stops(),
            "max_tokens": max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "seed": None if r.seed is None else str(r.seed),
            "logprobs": bool(r.logprobs),
            "top_logprobs": top or 0,
            "metadata": dict(r.metadata or {}),
            "stream": bool(r.stream),
            "include_usage": bool(r.stream_options and r.stream_options.include_usage),
            "session_id": sid,
        }
        if r.response_format is not None and r.response_format.type != "text":
            req["response_format"] = r.response_format.model_dump(by_alias=True)
        if sid is None:
            st = await self.runtime.open_session(
                "openai",
                label="openai chat",
                meta={"openai": API, "chat_template": self.turns.template.to_json()},
            )
            sid = st.session_id
        else:
            await self.runtime.live(sid)
        turn = await self.turns.start(
            sid,
            API,
            messages,
            req,
            params,
            OutputOptions(logprob_top_k=top or 0),
            live=bool(r.stream),
            use=use,
        )
        if r.stream:
            return self._sse(turn)
        await self.turns.wait(turn)
        return JSONResponse(await self._json(turn))

    # -- shapes -------------------------------------------------------------------

    def _header(self, turn: Turn) -> dict[str, Any]:
        return {
            "id": completion_id(turn),
            "created": int(turn.started.recorded_at),
            "model": turn.request.get("model"),
            "system_fingerprint": "st-" + self.runtime.engine.info.model_hash[:12],
            "session_id": turn.session_id,
            "seed": turn.seed,
        }

    def _usage(self, turn: Turn, completion: int) -> dict[str, Any]:
        return {
            "prompt_tokens": turn.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": turn.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": max(0, turn.prompt_tokens - turn.appended)},
        }

    def _logprob(self, e: Event) -> dict[str, Any]:
        return logprob_entry(self._detok(), e)

    async def _json(self, turn: Turn) -> dict[str, Any]:
        if turn.finished is None:  # its driver did not take the finish: the log has it
            turn = await load_turn(self.runtime, turn.session_id, turn.version, API)
        text, stopped = turn.text(self._detok())
        logprobs = None
        if turn.request.get("logprobs"):
            logprobs = {"content": [self._logprob(e) for e in turn.token_events], "refusal": None}
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        finish = _finish(turn.finish_reason, stopped)
        calls = turn_calls(turn, text)
        if calls:
            message = {**message, "content": None, "tool_calls": [_call_json(c) for c in calls]}
            finish = "tool_calls" if finish == "stop" else finish
        return {
            **self._header(turn),
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                }
            ],
            "usage": self._usage(turn, len(turn.tokens)),
        }

    def _sse(self, turn: Turn) -> Response:
        async def body() -> AsyncIterator[bytes]:
            done = False
            try:
                async for chunk in self.chunks(turn):
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                done = True
                yield b"data: [DONE]\n\n"
            except Exception as exc:
                done = True
                yield f"data: {json.dumps({'error': error_event(exc)})}\n\n".encode()
            finally:
                if not done:  # the client went away mid-stream: stop the generation
                    await self.turns.cancel(turn)

        return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)

    async def chunks(self, turn: Turn) -> AsyncIterator[dict[str, Any]]:
        head = {**self._header(turn), "object": "chat.completion.chunk"}
        logprobs = bool(turn.request.get("logprobs"))

        def chunk(
            delta: dict[str, Any], finish: str | None = None, lp: dict[str, Any] | None = None
        ) -> dict[str, Any]:
            return {
                **head,
                "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}],
            }

        yield chunk({"role": "assistant", "content": ""})
        ts = TextStream(self._detok(), turn.stops())
        reason = None
        generated = 0  # every token the generation made (past a stop string too), as the log
        # a reply that may be a call is held until its first character says which it is
        # (the grammar lets text begin with neither "{" nor "<"); a call's deltas follow
        # its finish, once its tool.called events are committed
        calls_possible = bool(tool_use_of(turn))
        mode = "text" if not calls_possible else None
        held: list[str] = []
        held_lps: list[dict[str, Any]] = []
        # one chunk per committed run: the tokens that are ready when the stream gets
        # to them share a delta (one token each while the reader keeps up), so a
        # reader slower than the engine gets fewer, longer chunks instead of a backlog
        async for run in self.turns.runs(turn):
            parts: list[str] = []
            lps: list[dict[str, Any]] = []
            for e in run:
                if e.type == T.GENERATION_FINISHED:
                    reason = str(typed_body(e, GenerationFinished).get("finish_reason"))
                    break
                tok = generated_token(e)
                if tok is None:
                    continue
                generated += 1
                if ts.stopped:
                    continue
                parts.append(ts.push(int(tok)))
                if logprobs:
                    lps.append(self._logprob(e))
            delta = "".join(parts)
            if mode != "text":
                held.append(delta)
                held_lps.extend(lps)
                start = "".join(held).lstrip()
                if start and mode is None:
                    mode = "call" if start[0] in "{<" else "text"
                if mode != "text":
                    if reason is not None:
                        break
                    continue
                delta, lps, held, held_lps = "".join(held), held_lps, [], []
            if lps:
                yield chunk({"content": delta}, lp={"content": lps, "refusal": None})
            elif delta:
                yield chunk({"content": delta})
            if reason is not None:
                break
        tail = ts.finish()
        finish = _finish(reason, ts.stopped)
        calls = turn_calls(turn, ts.text) if mode == "call" else []
        if calls:
            for i, c in enumerate(calls):
                opening = _call_json(dataclasses.replace(c, arguments=""), i)
                yield chunk({"tool_calls": [opening]})
                yield chunk({"tool_calls": [{"index": i, "function": {"arguments": c.arguments}}]})
            finish = "tool_calls" if finish == "stop" else finish
        elif mode != "text" and (held or tail):
            # not a call after all (cut short): the text, as an unstreamed reply shows it
            lp = {"content": held_lps, "refusal": None} if held_lps else None
            yield chunk({"content": "".join(held) + tail}, lp=lp)
        elif tail:
            yield chunk({"content": tail})
        yield chunk({}, finish)
        if turn.request.get("include_usage"):
            # the stream saw every generated token: no need to read the turn back
            yield {**head, "choices": [], "usage": self._usage(turn, generated)}


def _call_json(c: ToolCall, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": c.id,
        "type": "function",
        "function": {"name": c.name, "arguments": c.arguments},
    }
    return out if index is None else {"index": index, **out}


def _finish(reason: str | None, stopped: bool) -> str:
    if reason == "length" and not stopped:
        return "length"
    if reason == "error":
        raise E.EngineError("the generation failed (see the session's error.recorded event)")
    return "stop"
