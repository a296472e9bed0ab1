"""Short turns (append a few tokens, generate a few): few commits, no timer waits.

A short turn's cost is mostly fixed cost: its commits and their hand-offs. The
generation loop (core/generation/lifecycle.py) commits ``generation.finished`` with the
run that carries the last tokens when the engine ended on its own, and never
lingers for more steps once the engine has made its last one.
"""

from __future__ import annotations

import time

import pytest

from sessiontape.core.engine.interface import SamplingParams
from sessiontape.core.events import T
from sessiontape.core.generation.policy import RunPolicy
from sessiontape.core.generation.request import GenerateRequest
from sessiontape.core.runtime import Runtime
from sessiontape.engines.reference import EOS, ReferenceEngine
from tests.helpers.config import make_config
from tests.helpers.runtime import spy_commits


async def test_a_short_generations_finish_commits_with_its_last_tokens(
    any_runtime: Runtime,
) -> None:
    rt = any_runtime
    sid = (await rt.open_session("t", eos_token_ids=[])).session_id
    await rt.append_text(sid, "abc")
    commits = spy_commits(rt)
    evs = [
        e async for e in rt.generate(sid, GenerateRequest(SamplingParams(max_tokens=16, seed=3)))
    ]
    assert [e.type for e in evs][-1] == T.GENERATION_FINISHED
    fin = evs[-1].body
    assert fin["finish_reason"] == "length"
    assert fin["completion_tokens"] == 16
    # started with the first run of tokens (runs: as many as the engine's pace makes),
    # the last of them with the finish: no commit of its own for either
    assert commits[0][0] == T.GENERATION_STARTED
    assert T.GENERATION_TOKEN in commits[0]
    assert commits[-1][-1] == T.GENERATION_FINISHED
    assert T.GENERATION_TOKEN in commits[-1]
    assert sum(T.GENERATION_FINISHED in c for c in commits) == 1
    # the log holds what the caller saw, in the same order, and the fold agrees
    logged = [e for e in await rt.log.read(sid) if e.position >= evs[0].position]
    assert [e.hash for e in logged] == [e.hash for e in evs]
    st = await rt.sessions.load(sid)
    assert st.active_generation is None
    assert not rt.generations.is_running(sid)


async def test_an_eos_finish_commits_with_the_eos_token(sqlite_url: str) -> None:
    """The engine stops at EOS: the run that carries it carries the finish too."""
    rt = await Runtime.create(make_config(sqlite_url), engine=ReferenceEngine(eos_bias=1000.0))
    try:
        sid = (await rt.open_session("t")).session_id
        await rt.append_text(sid, "abc")
        commits = spy_commits(rt)
        evs = [
            e
            async for e in rt.generate(sid, GenerateRequest(SamplingParams(max_tokens=16, seed=1)))
        ]
        assert evs[-1].type == T.GENERATION_FINISHED
        assert evs[-1].body["finish_reason"] == "eos"
        assert evs[-2].body["token"] == EOS
        assert commits[-1][-2:] == [T.GENERATION_TOKEN, T.GENERATION_FINISHED]
        assert evs[-1].body["completion_tokens"] == 1
    finally:
        await rt.aclose()


async def test_no_wait_for_more_steps_once_the_engine_is_done(sqlite_url: str) -> None:
    """With a long linger (the committer waits up to ``linger_s`` for ``min_run``
    steps of a fast engine), a generation whose engine already finished commits
    what it made at once: the turn takes far less than the linger."""
    cfg = make_config(sqlite_url)
    rt = await Runtime.create(
        cfg, policy=RunPolicy(linger_s=2.0, min_run=64), engine=ReferenceEngine(eos_bias=-1000.0)
    )
    try:
        sid = (await rt.open_session("t")).session_id
        await rt.append_text(sid, "abc")
        for seed in range(3):
            t0 = time.perf_counter()
            evs = [
                e
                async for e in rt.generate(
                    sid, GenerateRequest(SamplingParams(max_tokens=16, seed=seed))
                )
            ]
            took = time.perf_counter() - t0
            assert evs[-1].body["completion_tokens"] == 16
            assert took < 1.0, f"a 16-token turn waited {took:.2f} s on the linger timer"
    finally:
        await rt.aclose()


@pytest.mark.parametrize("k", [0, 1, 8, 15])
async def test_a_caller_that_stops_after_the_last_run_leaves_one_finish(
    sqlite_url: str, k: int
) -> None:
    """Whether the caller stops before or after the run that carries the finish,
    the log ends the generation exactly once and counts what it holds."""
    rt = await Runtime.create(make_config(sqlite_url), engine=ReferenceEngine(eos_bias=-1000.0))
    try:
        sid = (await rt.open_session("t")).session_id
        await rt.append_text(sid, "abc")
        runs = rt.generate_runs(sid, GenerateRequest(SamplingParams(max_tokens=16, seed=k)))
        got = 0
        async for run in runs:
            got += sum(e.type == T.GENERATION_TOKEN and not e.body["is_prefill"] for e in run)
            if got > k:
                break
        await runs.aclose()  # type: ignore[attr-defined]
        evs = await rt.log.read(sid)
        fins = [e for e in evs if e.type == T.GENERATION_FINISHED]
        assert len(fins) == 1
        made = sum(e.type == T.GENERATION_TOKEN and not e.body["is_prefill"] for e in evs)
        assert fins[0].body["completion_tokens"] == made
        assert fins[0].body["finish_reason"] in ("length", "cancelled")
        assert (fins[0].body["finish_reason"] == "length") == (made == 16)
        assert not rt.generations.is_running(sid)
    finally:
        await rt.aclose()
