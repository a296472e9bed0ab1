"""The OpenAPI description of the OpenAI-compatible routes: their paths, and response and
stream-event schemas as components (docs/protocols/openai.md is the prose). Their request bodies'
schemas are their models' (:mod:`.bodies`), added by :mod:`..server.openapi`.

Only what this server answers is described: the extension fields every reply carries
(``session_id``, ``seed``) are in the response schemas. The event streams' ``data:`` payloads are
given by ``x-sse-data`` on the ``text/event-stream`` media type (OpenAPI 3.1 has no item schema
for streams). ``tests/transports/http/test_openapi.py`` checks every answer of these routes against
them.
"""

from __future__ import annotations

from typing import Any

_STR = {"type": "string"}
_INT = {"type": "integer"}
_BOOL = {"type": "boolean"}
_NUM = {"type": "number"}
_NSTR = {"type": ["string", "null"]}


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def obj(required: tuple[str, ...] = (), **props: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        out["required"] = list(required)
    return out


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"oneOf": [{"type": "null"}, schema]}


_SEED = {
    "type": "integer",
    "minimum": 0,
    "maximum": 2**64 - 1,
    "description": "extension: the seed (drawn and recorded when none is given)",
}
_ROLES = {"type": "string", "enum": ["system", "developer", "user", "assistant"]}
_TOP_LOGPROB = obj(
    ("token", "logprob", "bytes"),
    token=_STR,
    logprob=_NUM,
    bytes={"type": "array", "items": _INT},
)

SCHEMAS: dict[str, Any] = {
    "OpenAIError": obj(
        ("error",),
        error=obj(
            ("message", "type", "param", "code"),
            message=_STR,
            type={
                "type": "string",
                "enum": [
                    "invalid_request_error",
                    "authentication_error",
                    "rate_limit_error",
                    "server_error",
                ],
            },
            param=_NSTR,
            code=_NSTR,
        ),
    ),
    "Model": obj(
        ("id", "object", "created", "owned_by"),
        id=_STR,
        object={"const": "model"},
        created=_INT,
        owned_by=_STR,
        engine=_STR,
        provider=_STR,
        max_length=_INT,
        model_hash=_STR,
    ),
    "ModelList": obj(
        ("object", "data"), object={"const": "list"}, data={"type": "array", "items": ref("Model")}
    ),
    "Logprob": obj(
        ("token", "logprob", "bytes", "top_logprobs"),
        token=_STR,
        logprob=_NUM,
        bytes={"type": "array", "items": _INT},
        top_logprobs={"type": "array", "items": _TOP_LOGPROB},
    ),
    # -- Responses ------------------------------------------------------------------
    "OutputText": obj(
        ("type", "text", "annotations", "logprobs"),
        type={"const": "output_text"},
        text=_STR,
        annotations={"type": "array", "maxItems": 0},
        logprobs={"type": "array", "items": ref("Logprob")},
    ),
    "OutputMessage": obj(
        ("type", "id", "status", "role", "content"),
        type={"const": "message"},
        id=_STR,
        status={"type": "string", "enum": ["in_progress", "completed", "incomplete"]},
        role={"const": "assistant"},
        content={"type": "array", "items": ref("OutputText")},
    ),
    "ResponseUsage": obj(
        (
            "input_tokens",
            "input_tokens_details",
            "output_tokens",
            "output_tokens_details",
            "total_tokens",
        ),
        input_tokens=_INT,
        input_tokens_details=obj(("cached_tokens",), cached_tokens=_INT),
        output_tokens=_INT,
        output_tokens_details=obj(("reasoning_tokens",), reasoning_tokens=_INT),
        total_tokens=_INT,
    ),
    "Response": obj(
        (
            "id",
            "object",
            "created_at",
            "status",
            "background",
            "error",
            "incomplete_details",
            "model",
            "output",
            "store",
            "usage",
            "metadata",
            "session_id",
            "seed",
        ),
        id={"type": "string", "pattern": "^resp_.+_[0-9]+$"},
        object={"const": "response"},
        created_at=_INT,
        completed_at={"type": ["integer", "null"]},
        status={
            "type": "string",
            "enum": ["in_progress", "completed", "incomplete", "cancelled", "failed"],
        },
        background=_BOOL,
        error=nullable(obj(("code", "message"), code=_STR, message=_STR)),
        incomplete_details=nullable(obj(("reason",), reason={"const": "max_output_tokens"})),
        instructions=_NSTR,
        max_output_tokens={"type": ["integer", "null"]},
        model=_STR,
        output={"type": "array", "items": ref("OutputMessage"), "maxItems": 1},
        parallel_tool_calls={"const": False},
        previous_response_id=_NSTR,
        reasoning=obj(effort={"type": "null"}, summary={"type": "null"}),
        store=_BOOL,
        temperature=_NUM,
        text=obj(format=obj(type={"const": "text"})),
        tool_choice={"const": "none"},
        tools={"type": "array", "maxItems": 0},
        top_p=_NUM,
        top_logprobs=_INT,
        truncation={"const": "disabled"},
        usage=nullable(ref("ResponseUsage")),
        user={"type": "null"},
        metadata={"type": "object", "additionalProperties": _STR},
        session_id={"type": "string", "description": "extension: the session it lives in"},
        seed=_SEED,
    ),
    "ResponseStreamEvent": obj(
        ("type", "sequence_number"),
        type={
            "type": "string",
            "enum": [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed",
                "response.incomplete",
                "response.failed",
            ],
        },
        sequence_number={"type": "integer", "minimum": 0},
        response=ref("Response"),
        item=ref("OutputMessage"),
        part=ref("OutputText"),
        item_id=_STR,
        output_index={"const": 0},
        content_index={"const": 0},
        delta=_STR,
        text=_STR,
        logprobs={"type": "array", "items": ref("Logprob")},
    ),
    "ResponseErrorEvent": obj(
        ("type", "message", "code"),
        type={"const": "error"},
        sequence_number=_INT,
        message=_STR,
        code=_NSTR,
        param=_NSTR,
    ),
    "InputItem": obj(
        ("id", "type", "role", "status", "content"),
        id=_STR,
        type={"const": "message"},
        role=_ROLES,
        status={"const": "completed"},
        content={
            "type": "array",
            "items": obj(
                ("type", "text"),
                type={"type": "string", "enum": ["input_text", "output_text"]},
                text=_STR,
            ),
        },
    ),
    "InputItemList": obj(
        ("object", "data", "first_id", "last_id", "has_more"),
        object={"const": "list"},
        data={"type": "array", "items": ref("InputItem")},
        first_id=_NSTR,
        last_id=_NSTR,
        has_more=_BOOL,
    ),
    # -- Chat Completions --------------------------------------------------------------
    "ChatUsage": obj(
        ("prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"),
        prompt_tokens=_INT,
        completion_tokens=_INT,
        total_tokens=_INT,
        prompt_tokens_details=obj(("cached_tokens",), cached_tokens=_INT),
    ),
    "ChatLogprobs": nullable(
        obj(
            ("content",),
            content={"type": "array", "items": ref("Logprob")},
            refusal={"type": "null"},
        )
    ),
    "ChatCompletion": obj(
        ("id", "object", "created", "model", "choices", "usage", "session_id", "seed"),
        id={"type": "string", "pattern": "^chatcmpl-.+_[0-9]+$"},
        object={"const": "chat.completion"},
        created=_INT,
        model=_STR,
        system_fingerprint=_STR,
        choices={
            "type": "array",
            "minItems": 1,
            "maxItems": 1,
            "items": obj(
                ("index", "message", "logprobs", "finish_reason"),
                index={"const": 0},
                message=obj(
                    ("role", "content"),
                    role={"const": "assistant"},
                    content=_STR,
                    refusal={"type": "null"},
                ),
                logprobs=ref("ChatLogprobs"),
                finish_reason={"type": "string", "enum": ["stop", "length"]},
            ),
        },
        usage=ref("ChatUsage"),
        session_id={"type": "string", "description": "extension: the session it lives in"},
        seed=_SEED,
    ),
    "ChatCompletionChunk": obj(
        ("id", "object", "created", "model", "choices", "session_id", "seed"),
        id={"type": "string", "pattern": "^chatcmpl-.+_[0-9]+$"},
        object={"const": "chat.completion.chunk"},
        created=_INT,
        model=_STR,
        system_fingerprint=_STR,
        choices={
            "type": "array",
            "maxItems": 1,
            "description": "empty in the usage chunk (stream_options.include_usage)",
            "items": obj(
                ("index", "delta", "finish_reason"),
                index={"const": 0},
                delta=obj(role={"const": "assistant"}, content=_STR),
                logprobs=ref("ChatLogprobs"),
                finish_reason={"type": ["string", "null"], "enum": ["stop", "length", None]},
            ),
        },
        usage=ref("ChatUsage"),
        session_id=_STR,
        seed=_SEED,
    ),
}
#: what ends a chat stream that failed after it began: ``data: {"error": {...}}``
SCHEMAS["ChatStreamError"] = SCHEMAS["OpenAIError"]


def _json(name: str, desc: str = "OK") -> dict[str, Any]:
    return {"description": desc, "content": {"application/json": {"schema": ref(name)}}}


def _error(desc: str) -> dict[str, Any]:
    return _json("OpenAIError", desc)


_ERR = {
    "400": _error("a field this server refuses or cannot read"),
    "401": _error("missing or wrong bearer token"),
    "404": _error("unknown model, response or session"),
    "409": _error("the session is busy or closed"),
    "5XX": _error("the engine or the log failed"),
}

#: the error statuses each OpenAI route answers (each produced in tests/transports/http/test_openapi.py)
ERRORS_OF: dict[tuple[str, str], tuple[str, ...]] = {
    ("/v1/models", "get"): ("401",),
    ("/v1/models/{model}", "get"): ("401", "404"),
    ("/v1/responses", "post"): ("400", "401", "404", "409"),
    ("/v1/responses/{rid}", "get"): ("400", "401", "404"),
    ("/v1/responses/{rid}/cancel", "post"): ("400", "401", "404"),
    ("/v1/responses/{rid}/input_items", "get"): ("400", "401", "404"),
    ("/v1/chat/completions", "post"): ("400", "401", "404", "409", "5XX"),
}


def _op(
    path: str,
    method: str,
    summary: str,
    ok: dict[str, Any],
    *,
    params: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """An OpenAI route (its request body, if it takes one, is added by :mod:`..server.openapi`)."""
    responses = {**ok, **{k: _ERR[k] for k in ERRORS_OF[(path, method)]}}
    op: dict[str, Any] = {"summary": summary, "tags": ["openai"], "responses": responses}
    if params:
        op["parameters"] = params
    return op


def _path(name: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": _STR}


def _query(name: str, schema: dict[str, Any], desc: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "schema": schema, "description": desc}


def _stream(desc: str, event: str, error: str) -> dict[str, Any]:
    return {
        "schema": {"type": "string", "description": desc},
        "x-sse-data": ref(event),
        "x-sse-error": ref(error),
    }


def paths() -> dict[str, Any]:
    return {**_models(), **_responses(), **_chat()}


def _models() -> dict[str, Any]:
    return {
        "/v1/models": {
            "get": _op("/v1/models", "get", "the served model", {"200": _json("ModelList")})
        },
        "/v1/models/{model}": {
            "get": _op(
                "/v1/models/{model}",
                "get",
                "one model, by its id or its engine's name",
                {"200": _json("Model")},
                params=[_path("model")],
            )
        },
    }


def _responses() -> dict[str, Any]:
    response_or_stream = {
        "description": "the response; with stream=true its event stream",
        "content": {
            "application/json": {"schema": ref("Response")},
            "text/event-stream": _stream(
                "`event: <type>` and `data: <ResponseStreamEvent>`; a stream that fails after "
                "it began ends with `event: error` (ResponseErrorEvent)",
                "ResponseStreamEvent",
                "ResponseErrorEvent",
            ),
        },
    }
    rid = _path("rid")
    return {
        "/v1/responses": {
            "post": _op(
                "/v1/responses",
                "post",
                "create a response: a generation in a new session, or continuing (or forking) "
                "previous_response_id's",
                {"200": response_or_stream},
            )
        },
        "/v1/responses/{rid}": {
            "get": _op(
                "/v1/responses/{rid}",
                "get",
                "a stored response, rebuilt from the log; stream=true replays (then follows) its "
                "event stream after starting_after",
                {"200": response_or_stream},
                params=[
                    rid,
                    _query("stream", _BOOL, "answer with the response's event stream"),
                    _query(
                        "starting_after",
                        _INT,
                        "with stream=true: only the events after this sequence number",
                    ),
                ],
            )
        },
        "/v1/responses/{rid}/cancel": {
            "post": _op(
                "/v1/responses/{rid}/cancel",
                "post",
                "cancel a background response (a finished one is returned as it is)",
                {"200": _json("Response")},
                params=[rid],
            )
        },
        "/v1/responses/{rid}/input_items": {
            "get": _op(
                "/v1/responses/{rid}/input_items",
                "get",
                "the input messages of a response",
                {"200": _json("InputItemList")},
                params=[
                    rid,
                    _query(
                        "limit",
                        {"type": "integer", "minimum": 1, "maximum": 100, "default": 20},
                        "page size",
                    ),
                    _query(
                        "order",
                        {"type": "string", "enum": ["asc", "desc"], "default": "desc"},
                        "item order",
                    ),
                    _query("after", _STR, "an item id: the page starts after it"),
                ],
            )
        },
    }


def _chat() -> dict[str, Any]:
    completion_or_chunks = {
        "description": "the completion; with stream=true its chunks",
        "content": {
            "application/json": {"schema": ref("ChatCompletion")},
            "text/event-stream": _stream(
                "`data: <ChatCompletionChunk>` lines, then `data: [DONE]`; a stream that fails "
                "after it began ends with `data: <ChatStreamError>`",
                "ChatCompletionChunk",
                "ChatStreamError",
            ),
        },
    }
    return {
        "/v1/chat/completions": {
            "post": _op(
                "/v1/chat/completions",
                "post",
                "a chat completion, recorded as a session (session_id continues one)",
                {"200": completion_or_chunks},
            )
        }
    }
