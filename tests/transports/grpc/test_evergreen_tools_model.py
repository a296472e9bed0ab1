"""Evergreen tool calls on the default model (SmolLM2-135M-Instruct through ONNX Runtime),
against ``sessiontape serve`` over loopback gRPC: ``tool_choice`` required and named give
calls whose arguments validate against their schemas, the client's result goes into the
next GENERATE, the session document holds the call and the result, and ``audit
--reexecute`` of the sessions finds nothing diverged."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from sessiontape.transports.grpc.client import (
    EvergreenClient,
    action,
    fragment,
    sampling_config,
    text_fragments,
)
from sessiontape.transports.grpc.gen.evergreen.v2 import evergreen_pb2
from tests.helpers.config import free_port
from tests.helpers.evergreen import until_calls
from tests.helpers.schemas import CITY_TIME as TIME
from tests.helpers.schemas import WEATHER
from tests.helpers.serve import start, stop

TOOLS: list[dict[str, Any]] = [
    {"name": "get_weather", "description": "The current weather in a city", "parameters": WEATHER},
    {"name": "get_time", "description": "The local time in a city", "parameters": TIME},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, real_model_cache: Path) -> Iterator[Any]:
    """``sessiontape serve`` on the default model: gRPC and HTTP addresses, its folder."""
    tmp = tmp_path_factory.mktemp("serve")
    g, h = free_port(), free_port()
    proc, _ = start(
        tmp, "--grpc", f"127.0.0.1:{g}", "--http", f"127.0.0.1:{h}", cache=real_model_cache
    )
    try:
        yield f"127.0.0.1:{g}", f"http://127.0.0.1:{h}", tmp
    finally:
        stop(proc)


def generate(prompt: str, out: str, **config: Any) -> evergreen_pb2.Action:
    config = {"max_tokens": 60, "temperature": 0.7, "seed": 11, **config}
    return action(
        "GENERATE",
        inputs={"prompt": prompt},
        outputs={"text": out},
        configs=[sampling_config(tools=TOOLS, **config)],
    )


RESULTS = {"get_weather": "18 C and sunny", "get_time": "14:05"}


async def _loop(target: str, choice: str) -> tuple[str, list[evergreen_pb2.Action], list[Any]]:
    """Calls and their answers: the session id, the calls, their arguments."""
    async with EvergreenClient(target) as client, client.session() as s:
        sid = await s.session_id()
        await s.send(
            actions=[generate("p1", "r1", tool_choice=choice)],
            fragments=text_fragments("p1", "What is the weather and the time in Paris?", parts=1),
        )
        calls = await until_calls(s)
        nodes = {f.id: f.chunk_fragment.data for m in s.received for f in m.node_fragments}
        arguments = [json.loads(nodes[c.inputs[0].id]) for c in calls]
        for c, args in zip(calls, arguments, strict=True):
            jsonschema.validate(args, SCHEMAS[c.name])
        answers = [
            f for c in calls for f in text_fragments(c.outputs[0].id, RESULTS[c.name], parts=1)
        ]
        results = [n for c in calls for n in ("q2", c.outputs[0].id)]
        await s.send(
            fragments=[
                *answers,
                fragment("p2", child_ids=["p1", "r1", *results, "q3"]),
                *text_fragments("q2", "\nResult: ", parts=1),
                *text_fragments("q3", "\nAnswer:", parts=1),
            ],
            actions=[generate("p2", "r2", tool_choice="none", max_tokens=12)],
        )
        await s.done_writing()
        out = await s.collect()
    assert out["r2"]
    return sid, calls, arguments


def test_required_and_named_calls_validate_are_recorded_and_reexecute_bit_exactly(
    served: Any, real_model_cache: Path
) -> None:
    target, base, folder = served
    sid_required, calls, arguments = asyncio.run(_loop(target, "required"))
    sid_named, named, _ = asyncio.run(_loop(target, "get_time"))
    assert [c.name for c in named] == ["get_time"]

    # the session document: each call's action answered, its arguments and result nodes
    doc = httpx.get(f"{base}/v1/sessions/{sid_required}", timeout=30).json()
    sent = [a for a in doc["actions"] if a["direction"] == "out"]
    assert [a["name"] for a in sent] == [c.name for c in calls]
    assert all(a["status"] == "completed" for a in sent)
    for c, args in zip(calls, arguments, strict=True):
        assert json.loads(doc["nodes"][c.inputs[0].id]["text"]) == args
        assert doc["nodes"][c.outputs[0].id]["text"] == RESULTS[c.name]
    # when the reply was whole, each call was an action waiting for its result
    events = httpx.get(f"{base}/v1/sessions/{sid_required}/export", timeout=30).text
    finished = next(
        e["version"]
        for e in map(json.loads, events.splitlines())
        if e["type"] == "generation.finished"
    )
    then = httpx.get(f"{base}/v1/sessions/{sid_required}?version={finished}", timeout=30).json()
    waiting = [a for a in then["actions"] if a["direction"] == "out"]
    assert [(a["name"], a["status"]) for a in waiting] == [(c.name, "pending") for c in calls]

    env = {**os.environ, "SESSIONTAPE_CACHE": str(real_model_cache)}
    env.pop("SESSIONTAPE_DEFAULT_MODEL", None)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "sessiontape.core.cli",
            "audit",
            "--db",
            f"sqlite+aiosqlite:///{folder / 'st.db'}",
            "--reexecute",
            "--json",
            sid_required,
            sid_named,
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=folder,
        timeout=300,
    )
    reports = json.loads(out.stdout)
    assert [r["ok"] for r in reports] == [True, True], out.stdout + out.stderr
    assert all(r["divergences"] == [] and r["generations"] == 2 for r in reports)
