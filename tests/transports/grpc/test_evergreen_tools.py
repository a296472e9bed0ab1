"""Tool calls on the Evergreen wire (transports/grpc/evergreen_calls.py), against a real
grpc.aio server over loopback on the reference engine: GENERATE takes tools in its config,
a call the model makes comes back as an action with an arguments node, the client answers
with the result node, the next GENERATE reads both; every step is in the log and the
session document. Bad tool specs are INVALID_ARGUMENT and record nothing of their own."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest
from google.protobuf import json_format, struct_pb2
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from sessiontape.core.audit import audit_session
from sessiontape.core.document.fold import build_document
from sessiontape.core.events import Event, T
from sessiontape.core.log.store import EventLog
from sessiontape.core.runtime import Runtime
from sessiontape.core.tools import FALLBACK_PROMPT
from sessiontape.transports.grpc.client import (
    EvergreenClient,
    action,
    fragment,
    sampling_config,
    text_fragments,
)
from sessiontape.transports.grpc.gen.evergreen.v2 import evergreen_pb2
from tests.helpers.evergreen import exchange, msg, until_calls
from tests.helpers.schemas import STRICT_SCHEMAS
from tests.helpers.schemas import ZONE_TIME as TIME
from tests.transports.grpc.conftest import Served

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER},
    {"name": "get_time", "description": "The time in a zone", "parameters": TIME},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


def generate(prompt: str, out: str, **config: Any) -> evergreen_pb2.Action:
    config.setdefault("max_tokens", 120)
    config.setdefault("seed", 5)
    return action(
        "GENERATE",
        inputs={"prompt": prompt},
        outputs={"text": out},
        configs=[sampling_config(**config)],
    )


def call_config(a: evergreen_pb2.Action) -> dict[str, Any]:
    [packed] = a.configs
    s = struct_pb2.Struct()
    assert packed.Unpack(s)
    return dict(json_format.MessageToDict(s))


async def events(rt: Runtime, sid: str) -> list[Event]:
    return await rt.log.read(sid, 1, None)


async def test_a_tool_loop_call_result_and_the_next_generate(
    client: EvergreenClient, server: Served, tmp_path: Path
) -> None:
    rt = server.runtime
    async with client.session() as s:
        sid = await s.session_id()
        await s.send(
            actions=[generate("p1", "r1", tools=TOOLS, tool_choice="required")],
            fragments=text_fragments("p1", "Weather in Oslo?", parts=1),
        )
        [call] = await until_calls(s)
        # the call comes in the message that carries the reply's final fragment
        assert any(f.id == "r1" and not f.continued for f in s.received[-1].node_fragments)
        nodes = {f.id: f for m in s.received for f in m.node_fragments}
        # the call: an action named after the function, its arguments a JSON node
        assert call.name in SCHEMAS
        [arg_param], [res_param] = call.inputs, call.outputs
        assert (arg_param.name, res_param.name) == ("arguments", "result")
        args_node = nodes[arg_param.id]
        assert args_node.chunk_fragment.metadata.mimetype == "application/json"
        assert not args_node.continued
        arguments = json.loads(args_node.chunk_fragment.data)
        jsonschema.validate(arguments, SCHEMAS[call.name])
        call_id = call_config(call)["call_id"]
        # the output node holds the reply as generated: the call's JSON line
        reply = b"".join(
            f.chunk_fragment.data for m in s.received for f in m.node_fragments if f.id == "r1"
        ).decode()
        assert json.loads(reply) == {"name": call.name, "arguments": arguments}

        # the client answers, and asks again with the call and its result in the prompt
        await s.send(
            fragments=text_fragments(res_param.id, "rain, 4 C", parts=2),
            actions=[generate("p2", "r2", tools=TOOLS, tool_choice="none", max_tokens=8)],
        )
        await s.send(
            fragments=[
                fragment("p2", child_ids=["p1", "r1", "q2", res_param.id, "q3"]),
                *text_fragments("q2", "\nResult: ", parts=1),
                *text_fragments("q3", "\nSo the weather is", parts=1),
            ]
        )
        await s.done_writing()
        got = await s.collect()
    assert got["r2"]

    log = await events(rt, sid)
    of = {t: [e for e in log if e.type == t] for t in {e.type for e in log}}
    # tool.called: the model's, with its generation and the token span of its JSON
    [called] = of[T.TOOL_CALLED]
    assert called.body["supplied_by"] == "model" and called.body["call_id"] == call_id
    assert (called.body["name"], json.loads(called.body["arguments"])) == (call.name, arguments)
    first_gen = of[T.GENERATION_STARTED][0].body
    assert called.body["generation_id"] == first_gen["generation_id"]
    start, end = called.body["span"]
    assert first_gen["prompt_length"] <= start < end
    # ... committed with the generation's finish, with the call's action (direction out)
    finish = of[T.GENERATION_FINISHED][0]
    submitted_out = [e for e in of[T.ACTION_SUBMITTED] if e.body.get("direction") == "out"]
    [out_action] = submitted_out
    assert called.version < out_action.version < finish.version
    assert out_action.body["name"] == call.name
    assert out_action.body["outputs"] == [{"name": "result", "id": res_param.id}]
    # tool.result: the client's, the node's text, with the call's completion
    [result] = of[T.TOOL_RESULT]
    assert result.body == {
        "call_id": call_id,
        "name": call.name,
        "content": "rain, 4 C",
        "supplied_by": "client",
    }
    [done] = [
        e for e in of[T.ACTION_COMPLETED] if e.body["action_id"] == out_action.body["action_id"]
    ]
    assert done.version == result.version + 1
    # the next generation's prompt: the tools' description, then both nodes' text
    second = of[T.GENERATION_STARTED][1].body
    history = rt.engine.detokenize((await rt.get(sid)).tokens[: second["prompt_length"]])
    assert history.startswith(FALLBACK_PROMPT.split("{tools}")[0])
    assert history.endswith(f"Weather in Oslo?{reply}\nResult: rain, 4 C\nSo the weather is")

    # the session document: the call's action, its arguments and result nodes
    doc = build_document(sid, log, detokenize=rt.engine.detokenize)
    [doc_call] = [a for a in doc["actions"] if a["direction"] == "out"]
    assert doc_call["status"] == "completed" and doc_call["name"] == call.name
    assert doc["nodes"][res_param.id]["text"] == "rain, 4 C"
    assert json.loads(doc["nodes"][arg_param.id]["text"]) == arguments
    assert doc["conversation"] == []  # no chat request: the action and nodes show the call
    # a replay of the log is the live session: nodes and actions, the call's included
    live, replayed = await rt.get(sid), await rt.sessions.load(sid)
    assert replayed.actions == live.actions and replayed.nodes.keys() == live.nodes.keys()
    assert replayed.actions[out_action.body["action_id"]].direction == "out"
    # exported and imported into another database, the document is the same
    other = await EventLog.open(f"sqlite+aiosqlite:///{tmp_path / 'other.db'}")
    try:
        await other.import_events([Event.from_json(e.to_json()) for e in log])
        back = await other.read(sid)
    finally:
        await other.close()
    assert build_document(sid, back, detokenize=rt.engine.detokenize) == doc
    # re-executed under the recorded grammars, both generations are the recorded ones
    report = await audit_session(rt, sid, reexecute=True)
    assert report.ok and report.generations == 2 and not report.divergences, report.to_json()


async def test_a_named_choice_calls_that_function(client: EvergreenClient, server: Served) -> None:
    out = await exchange(
        client,
        server.runtime,
        msg(actions=[generate("p", "r", tools=TOOLS, tool_choice="get_time")]),
        msg(fragments=text_fragments("p", "What time is it?", parts=1)),
    )
    assert out.code == grpc.StatusCode.OK, out.details
    calls = [a for m in out.received for a in m.actions]
    assert [a.name for a in calls] == ["get_time"]
    args = out.nodes[calls[0].inputs[0].id]
    jsonschema.validate(json.loads(args), TIME)
    # the client ended its stream without answering: the call was cancelled
    [submitted] = [e for e in out.of(T.ACTION_SUBMITTED) if e.body.get("direction") == "out"]
    [failed] = out.of(T.ACTION_FAILED)
    assert failed.body["action_id"] == submitted.body["action_id"]
    assert failed.body["code"] == "cancelled"
    assert out.events[-1].type == T.SESSION_CLOSED
    assert not out.of(T.TOOL_RESULT)


async def test_auto_and_none_leave_text_as_text(client: EvergreenClient, server: Served) -> None:
    out = await exchange(
        client,
        server.runtime,
        msg(actions=[generate("p", "r", tools=TOOLS, tool_choice="none", max_tokens=10)]),
        msg(fragments=text_fragments("p", "Hello", parts=1)),
    )
    assert out.code == grpc.StatusCode.OK, out.details
    assert not out.of(T.TOOL_CALLED) and not [a for m in out.received for a in m.actions]
    [started] = out.of(T.GENERATION_STARTED)
    assert "constraint" not in started.body["params"]


BAD: list[Any] = [
    pytest.param(
        {"tools": [{"name": "no spaces", "parameters": WEATHER}]},
        "invalid_tool: tool name",
        id="name",
    ),
    pytest.param(
        {"tools": [{"name": "f", "parameters": [1]}]},
        "invalid_tool: tool f: parameters",
        id="params",
    ),
    pytest.param(
        {
            "tools": [
                {
                    "name": "f",
                    "parameters": {"type": "object", "properties": {"x": {"type": "frob"}}},
                }
            ]
        },
        "invalid_constraint: ",
        id="schema",
    ),
    pytest.param(
        {"tools": TOOLS, "tool_choice": "get_date"},
        "invalid_tool: tool_choice names 'get_date'",
        id="choice",
    ),
    pytest.param(
        {"tool_choice": "required"},
        "invalid_tool: GENERATE config: tool_choice without tools",
        id="choice-alone",
    ),
    pytest.param(
        {"parallel_tool_calls": False},
        "invalid_tool: GENERATE config: parallel_tool_calls without tools",
        id="parallel-alone",
    ),
    pytest.param({"tools": TOOLS + TOOLS[:1]}, "invalid_tool: tools: two functions", id="twice"),
    # (found by fuzzing: any number of tools was taken, and their description overflowed)
    pytest.param(
        {"tools": [{"name": f"f{i}"} for i in range(400)]},
        "invalid_tool: tools: 400 functions (at most 128)",
        id="many",
    ),
    pytest.param(
        {"tools": [{"name": "f", "description": {"a": 1}}]},
        "invalid_tool: tool f: description must be a string",
        id="description",
    ),
    pytest.param(
        {"tools": [{"name": "f", "strict": "yes"}]},
        "invalid_tool: tool f: strict must be a boolean",
        id="strict",
    ),
    pytest.param(
        {"tools": [{"name": "x" * 100_000}]},
        "invalid_tool: tool name must match [A-Za-z0-9_-]{1,64}: a string of 100,000 characters",
        id="huge-name",
    ),
    pytest.param(
        {"tools": [{"name": "f", "k" * 5000: 1}]},
        "invalid_tool: GENERATE config: unknown tool keys [a key of 5,000 characters]",
        id="huge-key",
    ),
    pytest.param(
        {"tools": [{"name": "f", "argz": {}}]},
        "invalid_tool: GENERATE config: unknown tool keys",
        id="key",
    ),
    pytest.param({"tools": [{"type": "web_search"}]}, "(only function)", id="type"),
    pytest.param(
        {"tools": TOOLS, "tool_choice": "required", "constraint": {"regex": "[0-9]+"}},
        "invalid_parameters: GENERATE config: a constraint and tools",
        id="constraint",
    ),
    pytest.param(
        {"tools": TOOLS, "parallel_tool_calls": "yes"},
        "invalid_parameters: GENERATE config 'parallel_tool_calls' has the wrong type",
        id="parallel",
    ),
]


@pytest.mark.parametrize(("config", "message"), BAD)
async def test_bad_tool_specs_are_invalid_argument_and_record_nothing(
    client: EvergreenClient, server: Served, config: dict[str, Any], message: str
) -> None:
    out = await exchange(
        client,
        server.runtime,
        msg(fragments=text_fragments("p", "Hi", parts=1)),
        msg(actions=[generate("p", "r", **config)]),
    )
    assert out.code == grpc.StatusCode.INVALID_ARGUMENT, (out.code, out.details)
    assert message in out.details
    # the prompt's fragment, then the abort: the bad action left nothing
    assert [e.type for e in out.events] == [
        T.SESSION_OPENED,
        T.NODE_FRAGMENT,
        T.SESSION_ABORTED,
    ]


async def test_a_result_that_is_not_text_is_invalid_and_not_recorded(
    client: EvergreenClient, server: Served
) -> None:
    rt = server.runtime
    async with client.session() as s:
        sid = await s.session_id()
        await s.send(
            actions=[generate("p", "r", tools=TOOLS, tool_choice="get_weather")],
            fragments=text_fragments("p", "Weather?", parts=1),
        )
        [call] = await until_calls(s)
        before = len(await events(rt, sid))
        await s.send(
            fragments=[fragment(call.outputs[0].id, data=b"\x89PNG", mimetype="image/png")]
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await s.collect()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "only text/* and application/json are read" in (err.value.details() or "")
    log = await events(rt, sid)
    # the image fragment is not recorded; the pending call is cancelled, the session aborted
    assert [e.type for e in log[before:]] == [T.ACTION_FAILED, T.SESSION_ABORTED]
    assert not [e for e in log if e.type == T.TOOL_RESULT]


async def test_a_result_in_parts_is_recorded_when_its_last_part_arrives(
    client: EvergreenClient, server: Served
) -> None:
    rt = server.runtime
    async with client.session() as s:
        sid = await s.session_id()
        await s.send(
            actions=[generate("p", "r", tools=TOOLS, tool_choice="get_time")],
            fragments=text_fragments("p", "Time?", parts=1),
        )
        [call] = await until_calls(s)
        result_id = call.outputs[0].id
        # a parent whose second child comes in a later message
        await s.send(
            fragments=[
                fragment(result_id, child_ids=["part1", "part2"]),
                fragment("part1", data=b'{"time": ', mimetype="application/json"),
            ]
        )
        await s.send(fragments=[fragment("part2", data=b'"14:05"}', mimetype="application/json")])
        await s.done_writing()
        await s.collect()
    log = await events(rt, sid)
    [result] = [e for e in log if e.type == T.TOOL_RESULT]
    assert result.body["content"] == '{"time": "14:05"}'
    # in the commit of the fragment that completed it: right after part2's fragment
    [part2] = [e for e in log if e.type == T.NODE_FRAGMENT and e.body["id"] == "part2"]
    assert result.version == part2.version + 1
    assert log[result.version].type == T.ACTION_COMPLETED  # (versions count from 1)


async def test_a_generate_without_outputs_still_sends_its_calls(
    client: EvergreenClient, server: Served
) -> None:
    out = await exchange(
        client,
        server.runtime,
        msg(
            actions=[
                action(
                    "GENERATE",
                    inputs={"prompt": "p"},
                    configs=[
                        sampling_config(max_tokens=120, seed=5, tools=TOOLS, tool_choice="required")
                    ],
                )
            ],
            fragments=text_fragments("p", "Weather?", parts=1),
        ),
    )
    assert out.code == grpc.StatusCode.OK, out.details
    calls = [a for m in out.received for a in m.actions]
    assert calls and all(a.name in SCHEMAS for a in calls)
    for a in calls:
        jsonschema.validate(json.loads(out.nodes[a.inputs[0].id]), SCHEMAS[a.name])
    assert len(out.of(T.TOOL_CALLED)) == len(calls)


@seed(51)
@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(schema=STRICT_SCHEMAS, gen_seed=st.integers(0, 2**32), parallel=st.booleans())
async def test_every_call_s_arguments_validate_against_its_schema(
    client: EvergreenClient, server: Served, schema: dict[str, Any], gen_seed: int, parallel: bool
) -> None:
    # the schemas travel in a Struct (numbers as doubles) and come out as they went in
    tools = [{"name": "first", "parameters": schema}, {"name": "second", "parameters": TIME}]
    out = await exchange(
        client,
        server.runtime,
        msg(
            actions=[
                generate(
                    "p",
                    "r",
                    tools=tools,
                    tool_choice="required",
                    parallel_tool_calls=parallel,
                    temperature=0.8,
                    max_tokens=600,
                    seed=str(gen_seed),
                )
            ],
            fragments=text_fragments("p", "call", parts=1),
        ),
    )
    assert out.code == grpc.StatusCode.OK, out.details
    calls = [a for m in out.received for a in m.actions]
    assert calls and (parallel or len(calls) == 1)
    for a in calls:
        args = json.loads(out.nodes[a.inputs[0].id])
        jsonschema.validate(args, schema if a.name == "first" else TIME)


DOC = Path(__file__).resolve().parents[3] / "docs" / "protocols" / "evergreen.md"


async def test_the_documented_tool_loop_runs_as_written(server: Served) -> None:
    [block] = [
        b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S) if "tool_loop" in b
    ]
    scope: dict[str, Any] = {}
    exec(compile(block, str(DOC), "exec"), scope)
    answer = await scope["tool_loop"](server.target)
    assert answer
    [sid] = [row.id for row in await server.runtime.reads.list_sessions()]
    log = await events(server.runtime, sid)
    [result] = [e for e in log if e.type == T.TOOL_RESULT]
    assert result.body["content"].startswith("rain, 4 C in ")
