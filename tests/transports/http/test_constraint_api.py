"""The native generate route's ``constraint``, and tool calls through the chat route on the
reference engine: recorded, exported and imported, forked from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from sessiontape.core.document.fold import build_document
from sessiontape.core.events import Event
from sessiontape.core.log.store import EventLog
from sessiontape.core.runtime import Runtime
from tests.helpers.schemas import STRICT_SCHEMAS

SCHEMA = {
    "type": "object",
    "properties": {
        "word": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
    },
    "required": ["word", "n", "ok"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {"name": "lookup", "parameters": SCHEMA, "strict": True},
}


async def _session(c: httpx.AsyncClient, text: str = "JSON: ") -> str:
    sid = str((await c.post("/v1/sessions", json={})).json()["id"])
    (await c.post(f"/v1/sessions/{sid}/append", json={"text": text})).raise_for_status()
    return sid


async def _generate(c: httpx.AsyncClient, sid: str, **body: Any) -> dict[str, Any]:
    r = await c.post(f"/v1/sessions/{sid}/generate", json={"stream": False, **body})
    assert r.status_code == 200, r.text
    return dict(r.json()["generation"])


def _text(tokens: list[int]) -> str:
    return bytes(t for t in tokens if t < 256).decode()


async def test_a_constrained_generation_and_its_fork_inside_the_json(
    client: httpx.AsyncClient,
) -> None:
    sid = await _session(client)
    body = {"max_tokens": 200, "seed": 3, "temperature": 0.9, "constraint": {"json_schema": SCHEMA}}
    gen = await _generate(client, sid, **body)
    tokens = [t["id"] for t in gen["tokens"]]
    assert gen["finish_reason"] == "eos"
    jsonschema.validate(json.loads(_text(tokens)), SCHEMA)
    recorded = gen["params"]["constraint"]
    assert recorded["kind"] == "json_schema" and recorded["start"] is None
    prompt = gen["prompt_length"]
    at = prompt + len(tokens) // 2
    child = (await client.post(f"/v1/sessions/{sid}/fork", json={"at_position": at})).json()["id"]
    again = await _generate(
        client,
        child,
        **{
            **body,
            "max_tokens": 200 - (at - prompt),
            "constraint": {"json_schema": SCHEMA, "start": prompt},
        },
    )
    assert [t["id"] for t in again["tokens"]] == tokens[at - prompt :]
    cut = await _generate(client, sid, **{**body, "max_tokens": 3})
    assert cut["finish_reason"] == "length" and cut["constraint_incomplete"] is True


async def test_a_bad_constraint_is_refused_with_nothing_appended(
    client: httpx.AsyncClient,
) -> None:
    sid = await _session(client)
    before = (await client.get(f"/v1/sessions/{sid}")).json()["version"]
    for constraint in (
        {"regex": "("},
        {"json_schema": {"type": "nonsense"}},
        {"regex": "[0-9]+", "start": 0},  # the history since 0 is not digits
        {"regex": "a", "grammar": "start: 'a'"},
    ):
        r = await client.post(
            f"/v1/sessions/{sid}/generate",
            json={"text": "more", "stream": False, "constraint": constraint},
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_constraint", r.text
    assert (await client.get(f"/v1/sessions/{sid}")).json()["version"] == before


async def test_tool_calls_are_recorded_exported_imported_and_forked_from(
    client: httpx.AsyncClient, runtime: Runtime, tmp_path: Path
) -> None:
    ask = [{"role": "user", "content": "look it up"}]
    r = await client.post(
        "/v1/chat/completions",
        json={
            "model": "reference",
            "messages": ask,
            "tools": [TOOL],
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_tokens": 200,
            "seed": 5,
        },
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMA)
    # the model's call is a turn of its own, and a fork at its end keeps it
    first = (await client.get(f"/v1/sessions/{r.json()['session_id']}")).json()
    [made] = [t for t in first["conversation"] if t["role"] == "tool_call"]
    assert made["call"] == {
        "id": call["id"],
        "name": "lookup",
        "arguments": call["function"]["arguments"],
        "supplied_by": "model",
    }
    fork = await client.post(f"/v1/sessions/{first['id']}/fork", json={"at_position": made["end"]})
    kept = [t for t in fork.json()["conversation"] if t["role"] == "tool_call"]
    assert kept and kept[0]["call"]["id"] == call["id"] and kept[0]["inherited"]
    # the client answers: the next request brings the call and its result
    r = await client.post(
        "/v1/chat/completions",
        json={
            "model": "reference",
            "messages": [
                *ask,
                choice["message"],
                {"role": "tool", "tool_call_id": call["id"], "content": "found"},
            ],
            "tools": [TOOL],
            "tool_choice": "none",
            "max_tokens": 5,
            "seed": 5,
        },
    )
    sid = r.json()["session_id"]
    export = (await client.get(f"/v1/sessions/{sid}/export")).text
    lines = [json.loads(line) for line in export.splitlines()]
    types = [ln["type"] for ln in lines]
    called = lines[types.index("tool.called")]["body"]
    result = lines[types.index("tool.result")]["body"]
    assert called["call_id"] == call["id"] == result["call_id"]
    assert called["supplied_by"] == "client" and result["content"] == "found"
    # imported into another database, the session's document still shows them
    other = await EventLog.open(f"sqlite+aiosqlite:///{tmp_path / 'other.db'}")
    try:
        events = [Event.from_json(ln) for ln in lines]
        await other.import_events(events)
        back = await other.read(sid)
    finally:
        await other.close()
    doc = build_document(sid, back)
    roles = [t["role"] for t in doc["conversation"]]
    assert roles[-3:] == ["tool_call", "tool", "assistant"], roles
    assert doc["conversation"][-2]["call_id"] == call["id"]
    # a fork right after the tool result's turn keeps the call and the result
    end = doc["conversation"][-2]["end"]
    fork = await client.post(f"/v1/sessions/{sid}/fork", json={"at_position": end})
    assert fork.status_code == 201, fork.text
    child = fork.json()
    assert [t["role"] for t in child["conversation"]] == roles[:-1]


async def _stream(c: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    async with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


async def test_streamed_replies_with_tools_equal_the_unstreamed_ones(
    client: httpx.AsyncClient,
) -> None:
    for choice, gen_seed in (("required", 5), ("auto", 1), ("auto", 2), ("auto", 3)):
        body = {
            "model": "reference",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [TOOL],
            "tool_choice": choice,
            "max_tokens": 40,
            "seed": gen_seed,
            "logprobs": True,
        }
        whole = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]
        chunks = await _stream(client, body)
        deltas = [ch["choices"][0] for ch in chunks if ch["choices"]]
        text = "".join(d["delta"].get("content") or "" for d in deltas)
        calls: dict[int, dict[str, Any]] = {}
        for d in deltas:
            for tc in d["delta"].get("tool_calls") or ():
                got = calls.setdefault(tc["index"], {"arguments": ""})
                got.update({k: v for k, v in tc.items() if k in ("id", "type")})
                fn = tc.get("function") or {}
                got["name"] = fn.get("name") or got.get("name")
                got["arguments"] += fn.get("arguments") or ""
        assert deltas[-1]["finish_reason"] == whole["finish_reason"]
        if whole["message"].get("tool_calls"):
            assert whole["finish_reason"] == "tool_calls" and text == ""
            assert [
                {"id": c["id"], "type": "function", **c["function"]}
                for c in whole["message"]["tool_calls"]
            ] == [calls[i] for i in sorted(calls)]
        else:
            assert text == whole["message"]["content"] and not calls
            streamed_lps = [e for d in deltas for e in (d.get("logprobs") or {}).get("content", [])]
            assert streamed_lps == whole["logprobs"]["content"]


@seed(51)
@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(schema=STRICT_SCHEMAS, gen_seed=st.integers(0, 2**32), parallel=st.booleans())
async def test_every_call_s_arguments_validate_against_its_schema(
    client: httpx.AsyncClient, schema: dict[str, Any], gen_seed: int, parallel: bool
) -> None:
    tools = [
        {"type": "function", "function": {"name": "first", "parameters": schema, "strict": True}},
        {"type": "function", "function": {"name": "second", "parameters": SCHEMA}},
    ]
    r = await client.post(
        "/v1/chat/completions",
        json={
            "model": "reference",
            "messages": [{"role": "user", "content": "call"}],
            "tools": tools,
            "tool_choice": "required",
            "parallel_tool_calls": parallel,
            "temperature": 0.8,
            "max_tokens": 600,
            "seed": gen_seed,
        },
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    calls = choice["message"]["tool_calls"]
    assert calls and (parallel or len(calls) == 1)
    for call in calls:
        fn = call["function"]
        jsonschema.validate(
            json.loads(fn["arguments"]), schema if fn["name"] == "first" else SCHEMA
        )
