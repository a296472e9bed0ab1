"""Hostile values at the core: strict stored JSON, parameter ranges, an audit that never crashes."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sessiontape.core.audit import audit_session
from sessiontape.core.engine.interface import SamplingParams
from sessiontape.core.errors import InvalidParameters, InvalidValue
from sessiontape.core.events import NewEvent, T, check_body
from sessiontape.core.generation.request import GenerateRequest
from sessiontape.core.runtime import Runtime
from tests.helpers.hostile import poison


@pytest.mark.parametrize(
    "body",
    [
        {"x": math.nan},
        {"x": [1.0, math.inf]},
        {"x": {"y": -math.inf}},
        {"x": 2**64},
        {"x": -(2**63) - 1},
        {"x": "\ud800"},
        {"\udfff": 1},
    ],
)
def test_new_event_refuses_values_json_cannot_store(body: dict[str, object]) -> None:
    with pytest.raises(InvalidValue):
        NewEvent(T.FEEDBACK, body)


def test_check_body_accepts_strict_json_and_refuses_deep_nesting() -> None:
    check_body({"a": None, "b": [1, 2.5, "null", True], "c": 2**64 - 1, "d": -(2**63)})
    deep: list[object] = []
    for _ in range(400):
        deep = [deep]
    with pytest.raises(InvalidValue):
        check_body({"x": deep})


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=math.nan),
        SamplingParams(temperature=math.inf),
        SamplingParams(temperature=-0.1),
        SamplingParams(top_p=0.0),
        SamplingParams(top_p=1.5),
        SamplingParams(top_p=math.nan),
        SamplingParams(top_k=-1),
        SamplingParams(max_tokens=-1),
        SamplingParams(max_tokens=2**31 + 1),
        SamplingParams(seed=-1),
        SamplingParams(seed=2**64),
        SamplingParams(stop_token_ids=(-1,)),
    ],
)
async def test_generate_refuses_out_of_range_params_before_anything_is_stored(
    runtime: Runtime, params: SamplingParams
) -> None:
    with pytest.raises(InvalidParameters):
        params.check()
    sid = (await runtime.open_session("http")).session_id
    await runtime.append_tokens(sid, [1, 2])
    before = [e.to_json() for e in await runtime.log.read(sid)]
    with pytest.raises(InvalidParameters):
        async for _ in runtime.generate(sid, GenerateRequest(params, append=[3])):
            pass
    assert [e.to_json() for e in await runtime.log.read(sid)] == before


def test_in_range_params_pass() -> None:
    SamplingParams(temperature=0.0, top_p=1.0, top_k=0, max_tokens=0, seed=2**64 - 1).check()


async def test_feedback_with_nan_is_refused_and_stores_nothing(runtime: Runtime) -> None:
    sid = (await runtime.open_session("http")).session_id
    with pytest.raises(InvalidValue):
        await runtime.record_feedback(sid, {"score": math.nan})
    with pytest.raises(InvalidValue):
        await runtime.open_session("http", meta={"n": 10**30})
    assert [e.type for e in await runtime.log.read(sid)] == [T.SESSION_OPENED]


async def test_audit_reports_unusable_recorded_params_and_goes_on(
    tmp_path: Path, runtime: Runtime
) -> None:
    good = (await runtime.open_session("http")).session_id
    bad = (await runtime.open_session("http")).session_id
    for sid in (good, bad):
        async for _ in runtime.generate(
            sid, GenerateRequest(SamplingParams(max_tokens=3, seed=1), append=[1, 2])
        ):
            pass
    url = runtime.log.url
    await poison(runtime.log, bad)
    report = await audit_session(runtime.log, bad, reexecute=True, engine=runtime.engine)
    assert not report.ok and report.chain_ok and not report.invariants_ok
    assert len(report.problems) == 1 and "generation.started" in report.problems[0], report.problems
    assert (await audit_session(runtime.log, good, reexecute=True, engine=runtime.engine)).ok
    proc = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            "sessiontape.core.cli",
            "audit",
            bad,
            "nope",
            good,
            "--reexecute",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SESSIONTAPE_DB": url},
        cwd=tmp_path,
    )
    out = json.loads(proc.stdout)
    assert proc.returncode == 1, proc.stderr
    assert [r["session_id"] for r in out] == [bad, "nope", good]
    assert [r["ok"] for r in out] == [False, False, True]
    assert out[1]["problems"] == ["session 'nope' not found"]
