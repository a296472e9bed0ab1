"""Fuzz function calling and structured outputs on the OpenAI routes over a real uvicorn on
loopback, on the reference engine: random ``tools``, ``tool_choice``, ``response_format``
(``text.format`` on Responses), tool messages answering unknown calls, malformed assistant
``tool_calls``.

Each request is answered, or refused with 400 in OpenAI's error shape (``{"error":
{"message", "type", "param", "code"}}``) whose code names the condition; never a 5xx; and a
refused request stores nothing (every session's events before and after).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sessiontape.core.errors import MAX_MESSAGE_BYTES
from tests.helpers.fuzz import LONG, QUICK, fuzz_settings
from tests.helpers.http_fuzz import Fuzzed, stored
from tests.helpers.tool_fuzz import JUNK, NAMES, SCHEMAS

MODEL = "reference-bigram-v1"

FUNCTION = st.fixed_dictionaries(
    {"name": NAMES},
    optional={
        "description": st.one_of(st.text(max_size=12), JUNK),
        "parameters": st.one_of(st.sampled_from(SCHEMAS), JUNK),
        "strict": st.one_of(st.booleans(), JUNK),
    },
)
CHAT_TOOL = st.one_of(
    st.fixed_dictionaries({"type": st.just("function"), "function": FUNCTION}),
    st.fixed_dictionaries({"type": st.one_of(st.just("web_search"), JUNK), "function": FUNCTION}),
    JUNK,
)
RESPONSE_TOOL = st.one_of(
    FUNCTION.map(lambda f: {"type": "function", **f}),
    st.fixed_dictionaries({"type": st.sampled_from(["web_search", "file_search", "x"])}),
    JUNK,
)
MODES = st.sampled_from(["auto", "none", "required"])
CHAT_CHOICE = st.one_of(
    MODES,
    NAMES.map(lambda n: {"type": "function", "function": {"name": n}}),
    JUNK,
)
RESPONSE_CHOICE = st.one_of(MODES, NAMES.map(lambda n: {"type": "function", "name": n}), JUNK)
SCHEMA_FORMAT = st.fixed_dictionaries(
    {"name": st.one_of(st.just("out"), NAMES)},
    optional={"schema": st.one_of(st.sampled_from(SCHEMAS), JUNK), "strict": JUNK},
)
CHAT_FORMAT = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema"])}),
    SCHEMA_FORMAT.map(lambda s: {"type": "json_schema", "json_schema": s}),
    JUNK,
)
RESPONSE_FORMAT = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema"])}),
    SCHEMA_FORMAT.map(lambda s: {"type": "json_schema", **s}),
    JUNK,
)
CALL_ID = st.one_of(st.sampled_from(["call_1", "call_1", "", "call_unknown"]), JUNK)
TOOL_CALL = st.one_of(
    st.fixed_dictionaries(
        {
            "id": CALL_ID,
            "type": st.sampled_from(["function", "function", "other"]),
            "function": st.one_of(
                st.fixed_dictionaries(
                    {
                        "name": NAMES,
                        "arguments": st.one_of(
                            st.sampled_from(['{"zone": 3}', "{", "", "[]"]), JUNK
                        ),
                    }
                ),
                JUNK,
            ),
        }
    ),
    JUNK,
)
CHAT_MESSAGES = st.lists(
    st.one_of(
        st.just({"role": "user", "content": "What time is it?"}),
        st.fixed_dictionaries(
            {"role": st.just("assistant"), "tool_calls": st.lists(TOOL_CALL, max_size=2)},
            optional={"content": st.one_of(st.none(), st.text(max_size=5))},
        ),
        st.fixed_dictionaries(
            {"role": st.just("tool"), "content": st.one_of(st.text(max_size=8), JUNK)},
            optional={"tool_call_id": CALL_ID, "name": NAMES},
        ),
    ),
    max_size=3,
)
RESPONSE_INPUT = st.one_of(
    st.just("What time is it?"),
    st.lists(
        st.one_of(
            st.just({"role": "user", "content": "What time is it?"}),
            st.fixed_dictionaries(
                {
                    "type": st.just("function_call"),
                    "call_id": CALL_ID,
                    "name": NAMES,
                    "arguments": st.one_of(st.just('{"zone": 3}'), JUNK),
                }
            ),
            st.fixed_dictionaries(
                {
                    "type": st.just("function_call_output"),
                    "call_id": CALL_ID,
                    "output": st.one_of(st.text(max_size=8), JUNK),
                }
            ),
        ),
        max_size=3,
    ).map(lambda items: [{"role": "user", "content": "What time is it?"}, *items]),
    JUNK,
)


@st.composite
def chat_bodies(draw: Any) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 16, "seed": 1}
    # a user's question, then (mostly) calls and results, good and bad
    body["messages"] = [{"role": "user", "content": "What time is it?"}, *draw(CHAT_MESSAGES)]
    if draw(st.integers(0, 4)):
        body["tools"] = draw(st.one_of(st.lists(CHAT_TOOL, max_size=3), JUNK))
    if draw(st.booleans()):
        body["tool_choice"] = draw(CHAT_CHOICE)
    if draw(st.integers(0, 3)) == 0:
        body["parallel_tool_calls"] = draw(st.one_of(st.booleans(), JUNK))
    if draw(st.integers(0, 2)) == 0:
        body["response_format"] = draw(CHAT_FORMAT)
    return "/v1/chat/completions", body


@st.composite
def response_bodies(draw: Any) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": MODEL, "max_output_tokens": 16, "store": False}
    body["input"] = draw(RESPONSE_INPUT)
    if draw(st.integers(0, 4)):
        body["tools"] = draw(st.one_of(st.lists(RESPONSE_TOOL, max_size=3), JUNK))
    if draw(st.booleans()):
        body["tool_choice"] = draw(RESPONSE_CHOICE)
    if draw(st.integers(0, 3)) == 0:
        body["parallel_tool_calls"] = draw(st.one_of(st.booleans(), JUNK))
    if draw(st.integers(0, 2)) == 0:
        body["text"] = {"format": draw(RESPONSE_FORMAT)}
    return "/v1/responses", body


BODIES = st.one_of(chat_bodies(), response_bodies())


async def _check(f: Fuzzed, path: str, body: dict[str, Any]) -> None:
    before = await stored(f)
    data = json.dumps(body, allow_nan=True).encode()
    r = await f.client.post(path, content=data, headers={"content-type": "application/json"})
    case = (path, body, r.status_code, r.content[:600])
    assert r.status_code < 500, case
    if r.status_code >= 400:
        assert r.status_code in (400, 413), case
        assert r.headers["content-type"].startswith("application/json"), case
        err = json.loads(r.content)["error"]
        assert set(err) == {"message", "type", "param", "code"}, case
        assert err["type"] == "invalid_request_error" and err["code"], case
        assert err["code"] != "internal", case
        # a NaN, an infinity or a body nested too deep is refused as the body is read
        assert err["code"] != "invalid_argument" or any(
            w in err["message"] for w in ("not a JSON number", "nested deeper")
        ), case
        assert 0 < len(err["message"].encode()) <= MAX_MESSAGE_BYTES + 64, case
        assert await stored(f) == before, case


@fuzz_settings(QUICK * 2)
@given(request=BODIES)
async def test_openai_tools_fuzz(fuzzed: Fuzzed, request: tuple[str, dict[str, Any]]) -> None:
    await _check(fuzzed, *request)


@pytest.mark.fuzz
@fuzz_settings(LONG)
@given(request=BODIES)
async def test_openai_tools_fuzz_long(fuzzed: Fuzzed, request: tuple[str, dict[str, Any]]) -> None:
    await _check(fuzzed, *request)
