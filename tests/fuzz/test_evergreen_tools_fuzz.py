"""Fuzz Evergreen's tool calls (transports/grpc/evergreen_config.py, evergreen_calls.py) over
real gRPC on loopback, on the reference engine.

Two inputs: a GENERATE's config (``tools``, ``tool_choice``, ``parallel_tool_calls``,
``constraint``: junk of every type, huge strings, bad and duplicate names, schemas llguidance
refuses, NaN and infinities, deep nesting), and the client's answer to a call (random result
fragments: mimetypes, refs, empty, split, wrong ids, the arguments node, a second result).
Either is accepted, or refused with INVALID_ARGUMENT (or another typed status) whose message
names the condition; never UNKNOWN or INTERNAL, nothing logged at ERROR, and a refused input
records nothing of its own (only the abort that follows it); the other sessions are untouched.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from google.protobuf import any_pb2, struct_pb2
from hypothesis import given
from hypothesis import strategies as st

from sessiontape.core.errors import MAX_MESSAGE_BYTES
from sessiontape.core.events import T
from sessiontape.transports.grpc.client import EvergreenClient, action, fragment, text_fragments
from sessiontape.transports.grpc.gen.evergreen.v2 import evergreen_pb2
from tests.helpers.evergreen import exchange, msg, until_calls
from tests.helpers.fuzz import LONG, QUICK, fuzz_settings
from tests.helpers.grpc_fuzz import FORBIDDEN, Fuzzed, fuzzed_server, stored
from tests.helpers.tool_fuzz import JUNK, NAMES, SCHEMAS, TIME

#: the codes a refused config names (the message's prefix)
CONFIG_CODES = ("invalid_parameters", "invalid_tool", "invalid_constraint", "invalid_value")


@pytest.fixture
async def fuzzed(sqlite_url: str) -> AsyncIterator[Fuzzed]:
    """The fuzz server with room for the tools' description in a prompt."""
    async with fuzzed_server(sqlite_url, max_length=4096) as f:
        yield f


@st.composite
def tool_specs(draw: Any) -> Any:
    spec: dict[str, Any] = {"name": draw(NAMES)}
    if draw(st.booleans()):
        spec["parameters"] = draw(st.one_of(st.sampled_from(SCHEMAS), JUNK))
    if draw(st.booleans()):
        spec["description"] = draw(st.one_of(st.text(max_size=20), JUNK))
    if draw(st.integers(0, 4)) == 0:
        spec["strict"] = draw(st.one_of(st.booleans(), JUNK))
    if draw(st.integers(0, 5)) == 0:
        spec[draw(st.sampled_from(["type", "argz", "function"]))] = draw(JUNK)
    if draw(st.integers(0, 4)) == 0:
        spec = {"type": "function", "function": spec}
    return draw(st.one_of(st.just(spec), st.just(spec), st.just(spec), JUNK))


@st.composite
def configs(draw: Any) -> dict[str, Any]:
    config: dict[str, Any] = {"max_tokens": 12, "seed": 1}
    if draw(st.integers(0, 5)):
        config["tools"] = draw(
            st.one_of(
                st.lists(tool_specs(), max_size=4),
                st.lists(tool_specs(), max_size=4),
                JUNK,
                st.just([{"name": f"f{i}"} for i in range(400)]),
            )
        )
    if draw(st.booleans()):
        config["tool_choice"] = draw(
            st.one_of(NAMES, st.sampled_from(["auto", "none", "required"]), JUNK)
        )
    if draw(st.integers(0, 3)) == 0:
        config["parallel_tool_calls"] = draw(st.one_of(st.booleans(), JUNK))
    if draw(st.integers(0, 3)) == 0:
        config["constraint"] = draw(
            st.one_of(
                st.fixed_dictionaries({"regex": st.sampled_from(["[0-9]+", "(", "x" * 5000])}),
                st.fixed_dictionaries({"json_schema": st.one_of(st.sampled_from(SCHEMAS), JUNK)}),
                JUNK,
            )
        )
    return config


def packed(config: dict[str, Any]) -> any_pb2.Any:
    """``config`` as a Struct (any JSON-like value: NaN and infinities as doubles)."""
    s = struct_pb2.Struct()
    s.update(config)
    out = any_pb2.Any()
    out.Pack(s)
    return out


async def _check_config(f: Fuzzed, config: dict[str, Any]) -> None:
    before = await stored(f)
    f.errors.clear()
    generate = action(
        "GENERATE", inputs={"prompt": "p"}, outputs={"text": "r"}, configs=[packed(config)]
    )
    async with EvergreenClient(f"127.0.0.1:{f.port}") as client:
        out = await exchange(
            client,
            f.runtime,
            msg(fragments=text_fragments("p", "What time is it?", parts=1)),
            msg(actions=[generate]),
        )
    assert out.code not in FORBIDDEN, (config, out.code, out.details, f.errors)
    assert not f.errors, (config, f.errors)
    assert len(out.details.encode("utf-8", "surrogatepass")) <= MAX_MESSAGE_BYTES + 64
    if out.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        # accepted, and too long for the model with its tools' description: the action failed
        assert out.details.startswith("context_overflow:"), (config, out.details)
        assert out.of(T.ACTION_SUBMITTED) and out.of(T.ACTION_FAILED), config
    elif out.code != grpc.StatusCode.OK:
        assert out.code == grpc.StatusCode.INVALID_ARGUMENT, (config, out.code, out.details)
        assert out.details.startswith(CONFIG_CODES), (config, out.details)
        # the prompt's fragment, then the abort: the refused action left nothing
        assert [e.type for e in out.events] == [
            T.SESSION_OPENED,
            T.NODE_FRAGMENT,
            T.SESSION_ABORTED,
        ], (config, out.details)
    else:
        assert out.of(T.ACTION_SUBMITTED), config
    assert await stored(f) == before


@fuzz_settings(QUICK * 2)
@given(config=configs())
async def test_generate_tool_config_fuzz(fuzzed: Fuzzed, config: dict[str, Any]) -> None:
    await _check_config(fuzzed, config)


@pytest.mark.fuzz
@fuzz_settings(LONG)
@given(config=configs())
async def test_generate_tool_config_fuzz_long(fuzzed: Fuzzed, config: dict[str, Any]) -> None:
    await _check_config(fuzzed, config)


# -- results --------------------------------------------------------------------------------

#: stand-ins for the ids a fuzzed fragment writes: the call's result and arguments nodes, the
#: GENERATE's output and prompt, a node of the client's own, one nobody named
#: the codes a refused answer names
REFUSED = {"invalid_fragment", "invalid_action", "protocol_violation", "invalid_value"}
IDS = ["@result", "@result", "@result", "@arguments", "r", "p", "mine", "@result-2", ""]
MIMETYPES = [
    "text/plain",
    "application/json",
    "image/png",
    "",
    "text/plain; type=EndOfTurn",
    "application/octet-stream",
]


@st.composite
def result_fragment(draw: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": draw(st.sampled_from(IDS)),
        "seq": draw(st.sampled_from([0, 0, 0, 1, 2, -1, 2**31 - 1])),
        "continued": draw(st.booleans()),
    }
    kind = draw(st.sampled_from(["leaf", "leaf", "ref", "parent", "empty"]))
    if kind == "parent":
        out["child_ids"] = draw(st.lists(st.sampled_from([*IDS, "c1", "c2"]), max_size=3))
    elif kind == "ref":
        out["ref"] = draw(st.sampled_from(["https://x/y", "", "ref" * 500]))
        out["mimetype"] = draw(st.sampled_from(MIMETYPES))
    elif kind == "leaf":
        out["data"] = draw(
            st.one_of(
                st.binary(max_size=12),
                st.sampled_from([b"", b'{"zone": 3}', b"\xff\xfe", b"x" * 70_000]),
            )
        )
        if out["seq"] == 0 or draw(st.booleans()):
            out["mimetype"] = draw(st.sampled_from(MIMETYPES))
    return out


def _fragments(
    specs: list[dict[str, Any]], ids: dict[str, str]
) -> list[evergreen_pb2.NodeFragment]:
    out = []
    for s in specs:
        frag = evergreen_pb2.NodeFragment(
            id=ids.get(s["id"], s["id"]),
            seq=s["seq"],
            continued=s["continued"],
            child_ids=[ids.get(c, c) for c in s.get("child_ids", ())],
        )
        if "data" in s or "ref" in s:
            chunk = frag.chunk_fragment
            chunk.SetInParent()
            if "mimetype" in s:
                chunk.metadata.mimetype = s["mimetype"]
            if "ref" in s:
                chunk.ref = s["ref"]
            else:
                chunk.data = s["data"]
        out.append(frag)
    return out


async def _settled(f: Fuzzed, sid: str, answered: bool) -> int:
    """How many events ``sid`` has once the call (and with ``answered`` its result) is in."""
    for _ in range(500):
        log = await f.runtime.log.read(sid, 1, None)
        if not answered or any(e.type == T.TOOL_RESULT for e in log):
            return len(log)
        await asyncio.sleep(0.01)
    raise AssertionError("the result was never recorded")


async def _check_result(f: Fuzzed, answer_first: bool, junk: list[dict[str, Any]]) -> None:
    before = await stored(f)
    f.errors.clear()
    config = packed(
        {
            "max_tokens": 120,
            "seed": 3,
            "tools": [{"name": "t", "parameters": TIME}],
            "tool_choice": "t",
        }
    )
    generate = action("GENERATE", inputs={"prompt": "p"}, outputs={"text": "r"}, configs=[config])
    async with EvergreenClient(f"127.0.0.1:{f.port}") as client, client.session() as s:
        sid = await s.session_id()
        await s.send(actions=[generate], fragments=text_fragments("p", "Time?", parts=1))
        [call] = await until_calls(s)
        ids = {"@result": call.outputs[0].id, "@arguments": call.inputs[0].id}
        ids["@result-2"] = ids["@result"] + "-2"
        if answer_first:
            await s.send(fragments=[fragment(ids["@result"], data=b"3", mimetype="text/plain")])
        known = await _settled(f, sid, answer_first)
        code, details = grpc.StatusCode.OK, ""
        try:
            await s.send(fragments=_fragments(junk, ids))
            await s.done_writing()
            await s.collect()
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details() or ""
    log = await f.runtime.log.read(sid, 1, None)
    case = (answer_first, junk, code, details, f.errors)
    assert code not in FORBIDDEN, case
    assert not f.errors, case
    results = [e for e in log if e.type == T.TOOL_RESULT]
    assert len(results) <= 1, case  # one result per call, whatever the client sends
    if answer_first:
        assert results[0].body["content"] == "3", case
    if code != grpc.StatusCode.OK:
        assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION), case
        assert details.split(":", 1)[0] in REFUSED, case
        # nothing of the refused message: the unanswered call cancelled, then the abort
        assert [e.type for e in log[known:]] in (
            [T.SESSION_ABORTED],
            [T.ACTION_FAILED, T.SESSION_ABORTED],
        ), case
    else:
        assert log[-1].type == T.SESSION_CLOSED, case
    assert await stored(f) == before


JUNK_MESSAGE = st.lists(result_fragment(), min_size=1, max_size=3)


@fuzz_settings(QUICK)
@given(answer_first=st.booleans(), junk=JUNK_MESSAGE)
async def test_tool_result_fuzz(
    fuzzed: Fuzzed, answer_first: bool, junk: list[dict[str, Any]]
) -> None:
    await _check_result(fuzzed, answer_first, junk)


@pytest.mark.fuzz
@fuzz_settings(LONG)
@given(answer_first=st.booleans(), junk=JUNK_MESSAGE)
async def test_tool_result_fuzz_long(
    fuzzed: Fuzzed, answer_first: bool, junk: list[dict[str, Any]]
) -> None:
    await _check_result(fuzzed, answer_first, junk)
