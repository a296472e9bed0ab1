"""Function calling and structured outputs through the official ``openai`` package, end to end
against ``sessiontape serve`` on the default model (SmolLM2-135M-Instruct, whose template has no
tool support: the fallback of core/tools.py), and the records they leave in the log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.helpers.config import free_port
from tests.helpers.schemas import CITY_TIME as TIME
from tests.helpers.schemas import WEATHER
from tests.helpers.serve import start, stop

MODEL = "smollm2-135m-instruct"

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER,
            "strict": True,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a city",
            "parameters": TIME,
            "strict": True,
        },
    },
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, real_model_cache: Path
) -> Iterator[tuple[str, Path]]:
    """``sessiontape serve`` on the default model: its base URL and its database's folder."""
    tmp = tmp_path_factory.mktemp("serve")
    port = free_port()
    proc, _ = start(tmp, "--http", f"127.0.0.1:{port}", cache=real_model_cache)
    try:
        yield f"http://127.0.0.1:{port}", tmp
    finally:
        stop(proc)


@pytest.fixture
def client(served: tuple[str, Path]) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0)


def _events(base: str, sid: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{base}/v1/sessions/{sid}/export", timeout=30)
    r.raise_for_status()
    return [json.loads(line) for line in r.text.splitlines()]


def _check_call(call: Any) -> dict[str, Any]:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def test_a_two_tool_loop_recorded_call_by_call(
    client: openai.OpenAI, served: tuple[str, Path]
) -> None:
    messages: list[Any] = [
        {"role": "user", "content": "What is the weather and the time in Paris?"}
    ]
    answers = {"get_weather": "Sunny, 21 degrees celsius", "get_time": "14:05"}
    called: list[str] = []
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=TOOLS,
            tool_choice=choice,  # type: ignore[arg-type]
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=60,
        )
        c = reply.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        [call] = c.message.tool_calls or []
        _check_call(call)
        called.append(call.function.name)
        messages.append(c.message.model_dump(exclude_none=True))
        messages.append(
            {"role": "tool", "tool_call_id": call.id, "content": answers[call.function.name]}
        )
    assert called[1] == "get_time"
    final = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        max_tokens=40,
    )
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.choices[0].message.tool_calls is None and final.choices[0].message.content
    # the last session holds the whole loop: the calls and results its request brought
    sid = final.session_id  # type: ignore[attr-defined]
    events = _events(served[0], sid)
    calls = [e["body"] for e in events if e["type"] == "tool.called"]
    results = [e["body"] for e in events if e["type"] == "tool.result"]
    assert [c["name"] for c in calls] == called
    assert all(c["supplied_by"] == "client" and c["generation_id"] is None for c in calls)
    assert [r["call_id"] for r in results] == [c["call_id"] for c in calls]
    assert [r["content"] for r in results] == [answers[n] for n in called]
    doc = httpx.get(f"{served[0]}/v1/sessions/{sid}", timeout=30).json()
    roles = [t["role"] for t in doc["conversation"]]
    assert roles == ["user", "tool_call", "tool", "tool_call", "tool", "assistant"], roles
    tool_turns = [t for t in doc["conversation"] if t["role"] == "tool"]
    assert [t["call_id"] for t in tool_turns] == [c["call_id"] for c in calls]


def test_a_model_call_is_an_event_with_its_generation_and_token_span(
    client: openai.OpenAI, served: tuple[str, Path]
) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Oslo, please."}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=60,
    )
    [call] = reply.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"
    _check_call(call)
    sid = reply.session_id  # type: ignore[attr-defined]
    events = _events(served[0], sid)
    types = [e["type"] for e in events]
    called = events[types.index("tool.called")]
    finished = events[types.index("generation.finished")]
    assert called["version"] == finished["version"] - 1  # committed with the finish
    b = called["body"]
    assert b["call_id"] == call.id and b["arguments"] == call.function.arguments
    assert b["supplied_by"] == "model"
    started = next(e for e in events if e["type"] == "generation.started")["body"]
    assert b["generation_id"] == started["generation_id"]
    assert started["params"]["constraint"]["kind"] == "grammar"
    first, end = b["span"]
    tokens = [
        e["body"]["position"]
        for e in events
        if e["type"] == "generation.token" and not e["body"]["is_prefill"]
    ]
    assert tokens[0] == first and first < end <= tokens[-1] + 1
    doc = httpx.get(f"{served[0]}/v1/sessions/{sid}", timeout=30).json()
    [turn] = [t for t in doc["conversation"] if t["role"] == "tool_call"]
    assert turn["call"]["id"] == call.id and turn["call"]["supplied_by"] == "model"
    assert (turn["start"], turn["end"]) == (first, end)


def test_tool_choice_required_and_auto_and_streamed_deltas(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "What time is it in Tokyo?"}]
    with client.chat.completions.stream(
        model=MODEL, messages=ask, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=60
    ) as stream:
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls or []
    assert calls and final.choices[0].finish_reason == "tool_calls"
    for call in calls:  # parallel calls: one JSON line each
        _check_call(call)
    unstreamed = client.chat.completions.create(
        model=MODEL, messages=ask, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=60
    )
    same = unstreamed.choices[0].message.tool_calls or []
    assert [(c.function.name, c.function.arguments) for c in same] == [
        (c.function.name, c.function.arguments) for c in calls
    ]
    # auto: text or a call, each as it should be
    auto = client.chat.completions.create(
        model=MODEL, messages=ask, tools=TOOLS, temperature=0, max_tokens=60
    )
    m = auto.choices[0].message
    if m.tool_calls:
        assert auto.choices[0].finish_reason == "tool_calls"
        for c in m.tool_calls:
            _check_call(c)
    else:
        assert m.content


class Kind(StrEnum):
    capital = "capital"
    town = "town"


class Landmark(BaseModel):
    name: str
    year: int | None


class City(BaseModel):
    name: str
    kind: Kind
    country: Literal["France", "Italy", "Spain"]
    # bounded: greedy decoding on a 135M model repeats an array's last item without end
    landmarks: list[Landmark] = Field(max_length=3)
    mayor: str | None


def test_chat_completions_parse_a_pydantic_model(client: openai.OpenAI) -> None:
    reply = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris in JSON."}],
        response_format=City,
        temperature=0,
        max_tokens=300,
    )
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, City) and reply.choices[0].finish_reason == "stop"
    assert isinstance(parsed.kind, Kind) and parsed.country in ("France", "Italy", "Spain")


def test_json_object_and_a_cut_short_schema(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "A JSON object with a cat's name."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=200,
    )
    c = reply.choices[0]
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content or ""), dict)
    else:
        assert c.finish_reason == "length"
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": "Describe Paris in JSON."}],
            response_format=City,
            temperature=0,
            max_tokens=5,
        )


class Answer(BaseModel):
    explanation: str
    output: str


def test_responses_parse_and_a_function_call_loop(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(
        model=MODEL,
        input="What is the capital of France?",
        text_format=Answer,
        temperature=0,
        max_output_tokens=200,
    )
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Answer)
    tools: list[Any] = [{"type": "function", **t["function"]} for t in TOOLS]
    first = client.responses.create(
        model=MODEL,
        input="What's the weather in Rome?",
        tools=tools,
        tool_choice="required",
        temperature=0,
        max_output_tokens=60,
    )
    [call] = first.output
    assert call.type == "function_call"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Rain, 12C"}],
        tools=tools,
        tool_choice="none",
        temperature=0,
        max_output_tokens=40,
    )
    assert second.output_text and second.session_id == first.session_id  # type: ignore[attr-defined]
    items = client.responses.input_items.list(second.id)
    assert [i.type for i in items.data] == ["function_call_output"]
    events = [e.type for e in client.responses.create(
        model=MODEL,
        input="What's the weather in Rome?",
        tools=tools,
        tool_choice="required",
        temperature=0,
        max_output_tokens=60,
        stream=True,
    )]  # fmt: skip
    assert "response.function_call_arguments.done" in events
    assert events[-1] == "response.completed"


def test_audit_reexecutes_tool_calls_and_structured_outputs_bit_exactly(
    client: openai.OpenAI, served: tuple[str, Path], real_model_cache: Path
) -> None:
    sids = []
    for kwargs in (
        {"tools": TOOLS, "tool_choice": "required", "max_tokens": 60},
        {"response_format": {"type": "json_object"}, "max_tokens": 60},
    ):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Weather in Lyon as JSON?"}],
            temperature=0.7,
            seed=11,
            **kwargs,  # type: ignore[arg-type]
        )
        sids.append(reply.session_id)  # type: ignore[attr-defined]
    env = {**os.environ, "SESSIONTAPE_CACHE": str(real_model_cache)}
    env.pop("SESSIONTAPE_DEFAULT_MODEL", None)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "sessiontape.core.cli",
            "audit",
            "--db",
            f"sqlite+aiosqlite:///{served[1] / 'st.db'}",
            "--reexecute",
            "--json",
            *sids,
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=served[1],
        timeout=300,
    )
    reports = json.loads(out.stdout)
    assert [r["ok"] for r in reports] == [True, True], out.stdout + out.stderr
    assert all(r["divergences"] == [] and r["generations"] == 1 for r in reports)
