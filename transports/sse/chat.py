"""``/v1/chat/completions``: OpenAI's Chat Completions API over sessions.

Each call is a turn (:mod:`sessiontape.transports.sse.turns`) in a new session, so it
can be audited, replayed and exported; its id is
``chatcmpl-<session id>_<version of generation.started>``, and every reply
carries the session's id as the extension field ``session_id``. A request
that names a ``session_id`` continues that session: only the new messages
are sent, rendered after what the session holds (its cached KV is reused).
``n`` must be 1; ``stop`` strings end the reply early (the text stops
before them).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from sessiontape.core import errors as E
from sessiontape.core.bodies import GenerationFinished, generated_token
from sessiontape.core.bodies import body as typed_body
from sessiontape.core.document.text import TextStream
from sessiontape.core.engine import OutputOptions, SamplingParams
from sessiontape.core.events import Event, T
from sessiontape.transports.sse.chat_template import ROLES, message_text
from sessiontape.transports.sse.openai import (
    DEFAULT_MAX_TOKENS,
    Api,
    BadParam,
    Models,
    check_fields,
    error_event,
    flag,
    integer,
    json_body,
    metadata,
    number,
    reject_unsupported,
)
from sessiontape.transports.sse.turns import Turn, Turns, follow_runs, load_turn, logprob_entry

API = "chat.completions"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


#: the request fields read (the unsupported ones only to refuse them unless they ask for
#: nothing); any other is refused (openai.check_fields)
UNSUPPORTED = (
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "logit_bias",
    "audio",
    "prediction",
    "frequency_penalty",
    "presence_penalty",
    "reasoning_effort",
    "web_search_options",
)
FIELDS = frozenset(
    {
        "model",
        "messages",
        "n",
        "stream",
        "stream_options",
        "logprobs",
        "top_logprobs",
        "max_tokens",
        "max_completion_tokens",
        "seed",
        "temperature",
        "top_p",
        "stop",
        "metadata",
        "response_format",
        "modalities",
        "store",
        "session_id",
        *UNSUPPORTED,
    }
)


def completion_id(turn: Turn) -> str:
    return f"chatcmpl-{turn.session_id}_{turn.version}"


def _messages(b: dict[str, Any]) -> list[tuple[str, str]]:
    raw = b.get("messages")
    if not isinstance(raw, list) or not raw:
        raise BadParam("messages", "messages must be a non-empty array")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadParam(
                f"messages[{i}].role", f"messages[{i}].role must be one of {list(ROLES)}"
            )
        if m.get("tool_calls") or m.get("function_call"):
            raise BadParam(f"messages[{i}]", "tool calls are not supported by this server")
        out.append((str(m["role"]), message_text(m.get("content"), f"messages[{i}]")))
    return out


def _stop(b: dict[str, Any]) -> list[str]:
    v = b.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if (
        not isinstance(stops, list)
        or len(stops) > 4
        or any(not isinstance(s, str) or not s for s in stops)
    ):
        raise BadParam("stop", "stop must be a non-empty string or an array of at most 4 of them")
    return list(stops)


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
        check_fields(b, FIELDS)
        model = self.models.check(b)
        reject_unsupported(b, UNSUPPORTED)
        if b.get("modalities") not in (None, ["text"]):
            raise BadParam("modalities", 'only modalities ["text"] is supported')
        flag(b, "store", True)  # every completion is recorded: store=false changes nothing
        fmt = b.get("response_format")
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
            raise BadParam("response_format", 'only response_format {"type": "text"} is supported')
        messages = _messages(b)
        n = integer(b, "n", 1, 128)
        if n not in (None, 1):
            raise BadParam("n", "n must be 1 (one session per choice: send one request per choice)")
        stream = flag(b, "stream", False)
        opts = b.get("stream_options")
        if opts is not None and (not isinstance(opts, dict) or not stream):
            raise BadParam(
                "stream_options", "stream_options is an object, and only with stream=true"
            )
        include_usage = flag(opts or {}, "include_usage", False)
        want_logprobs = flag(b, "logprobs", False)
        top = integer(b, "top_logprobs", 0, 20)
        if top is not None and not want_logprobs:
            raise BadParam("top_logprobs", "top_logprobs needs logprobs=true")
        max_tokens = integer(b, "max_completion_tokens", 1, 1 << 20)
        if max_tokens is None:
            max_tokens = integer(b, "max_tokens", 1, 1 << 20)
        seed = integer(b, "seed", 0, (1 << 63) - 1)
        params = SamplingParams(
            max_tokens=max_tokens or DEFAULT_MAX_TOKENS,
            temperature=number(b, "temperature", 1.0, 0.0, 2.0),
            top_p=number(b, "top_p", 1.0, 0.0, 1.0, lo_open=True),
            seed=seed,
        )
        sid = b.get("session_id")
        if sid is not None and not isinstance(sid, str):
            raise BadParam("session_id", "session_id must be a string")
        req = {
            "model": model,
            "messages": [{"role": r, "content": c} for r, c in messages],
            "stop": _stop(b),
            "max_tokens": max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "seed": None if seed is None else str(seed),
            "logprobs": want_logprobs,
            "top_logprobs": top or 0,
            "metadata": metadata(b),
            "stream": stream,
            "include_usage": include_usage,
            "session_id": sid,
        }
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
            sid, API, messages, req, params, OutputOptions(logprob_top_k=top or 0)
        )
        if stream:
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

    def _usage(self, turn: Turn) -> dict[str, Any]:
        return {
            "prompt_tokens": turn.prompt_tokens,
            "completion_tokens": len(turn.tokens),
            "total_tokens": turn.prompt_tokens + len(turn.tokens),
            "prompt_tokens_details": {"cached_tokens": max(0, turn.prompt_tokens - turn.appended)},
        }

    def _logprob(self, e: Event) -> dict[str, Any]:
        return logprob_entry(self._detok(), e)

    async def _json(self, turn: Turn) -> dict[str, Any]:
        turn = await load_turn(self.runtime, turn.session_id, turn.version, API)
        text, stopped = turn.text(self._detok())
        logprobs = None
        if turn.request.get("logprobs"):
            logprobs = {"content": [self._logprob(e) for e in turn.token_events], "refusal": None}
        return {
            **self._header(turn),
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text, "refusal": None},
                    "logprobs": logprobs,
                    "finish_reason": _finish(turn.finish_reason, stopped),
                }
            ],
            "usage": self._usage(turn),
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
        # one chunk per committed run: the tokens that are ready when the stream gets
        # to them share a delta (one token each while the reader keeps up), so a
        # reader slower than the engine gets fewer, longer chunks instead of a backlog
        async for run in follow_runs(self.runtime, turn):
            parts: list[str] = []
            lps: list[dict[str, Any]] = []
            for e in run:
                if e.type == T.GENERATION_FINISHED:
                    reason = str(typed_body(e, GenerationFinished).get("finish_reason"))
                    break
                tok = generated_token(e)
                if ts.stopped or tok is None:
                    continue
                parts.append(ts.push(int(tok)))
                if logprobs:
                    lps.append(self._logprob(e))
            delta = "".join(parts)
            if lps:
                yield chunk({"content": delta}, lp={"content": lps, "refusal": None})
            elif delta:
                yield chunk({"content": delta})
            if reason is not None:
                break
        tail = ts.finish()
        if tail:
            yield chunk({"content": tail})
        yield chunk({}, _finish(reason, ts.stopped))
        if turn.request.get("include_usage"):
            final = await load_turn(self.runtime, turn.session_id, turn.version, API)
            yield {**head, "choices": [], "usage": self._usage(final)}


def _finish(reason: str | None, stopped: bool) -> str:
    if reason == "length" and not stopped:
        return "length"
    if reason == "error":
        raise E.EngineError("the generation failed (see the session's error.recorded event)")
    return "stop"
