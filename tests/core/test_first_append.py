"""A generation's first append (the request's tokens, any truncation,
``generation.started``) commits with its first run of tokens, and with its end
when it ends before one commits (core/generation/lifecycle.py)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessiontape.core.engine.interface import SamplingParams
from sessiontape.core.errors import EngineError
from sessiontape.core.events import Event, T
from sessiontape.core.generation.request import GenerateRequest
from sessiontape.core.runtime import Runtime
from tests.helpers.config import make_config
from tests.helpers.runtime import SpyEngine, spy_commits


async def test_a_short_turn_is_one_commit_and_the_caller_sees_no_append(
    any_runtime: Runtime,
) -> None:
    """Append 3, generate 16: the append, ``generation.started``, the tokens and the
    finish commit together, on either database; the caller is shown what it was
    before: ``generation.started``, the tokens, the finish."""
    rt = any_runtime
    sid = (await rt.open_session("t", eos_token_ids=[])).session_id
    await rt.append_text(sid, "abc")
    commits = spy_commits(rt)
    params = SamplingParams(max_tokens=16, seed=3)
    seen = [e async for e in rt.generate(sid, GenerateRequest(params, append=[65, 66, 67]))]
    assert seen[0].type == T.GENERATION_STARTED
    assert [e.type for e in seen[1:-1]] == [T.GENERATION_TOKEN] * 16
    assert seen[-1].type == T.GENERATION_FINISHED
    assert commits[0][:2] == [T.TOKENS_APPENDED, T.GENERATION_STARTED]
    assert T.GENERATION_TOKEN in commits[0]
    assert commits[-1][-1] == T.GENERATION_FINISHED
    evs = await rt.log.read(sid)
    logged = [e for e in evs if e.position >= seen[0].position]
    assert [e.hash for e in logged] == [e.hash for e in seen]  # durable before visible
    appended = [e for e in evs if e.type == T.TOKENS_APPENDED]
    assert appended[-1].body["tokens"] == [65, 66, 67]
    assert appended[-1].position < seen[0].position
    state = await rt.sessions.load(sid)
    assert state.tokens[: len(state.tokens) - 16][-3:].tolist() == [65, 66, 67]
    assert seen[0].body["prompt_length"] == state.length - 16


async def test_start_apart_commits_the_first_append_before_any_token(runtime: Runtime) -> None:
    rt = runtime
    sid = (await rt.open_session("t", eos_token_ids=[])).session_id
    commits = spy_commits(rt)
    runs = rt.generate_runs(
        sid, GenerateRequest(SamplingParams(max_tokens=4, seed=1), append=[70], start_apart=True)
    )
    async with contextlib.aclosing(runs):
        first = await anext(runs)
        assert [e.type for e in first] == [T.GENERATION_STARTED]
        assert commits == [[T.TOKENS_APPENDED, T.GENERATION_STARTED]]
        rest = [e async for run in runs for e in run]
    assert rest[-1].type == T.GENERATION_FINISHED
    assert [T.GENERATION_STARTED in c for c in commits] == [True] + [False] * (len(commits) - 1)


async def _settled(rt: Runtime, sid: str) -> tuple[list[Event], Any]:
    for _ in range(200):
        if not rt.generations.is_running(sid):
            break
        await asyncio.sleep(0.01)
    assert not rt.generations.is_running(sid)
    return await rt.log.read(sid), await rt.sessions.load(sid)


@pytest.mark.parametrize("how", ["cancelled", "error"])
async def test_a_generation_ended_before_its_first_run_commits_its_append_with_the_end(
    sqlite_url: str, how: str
) -> None:
    """The caller went away, or the engine failed, before any token: the request's
    append and ``generation.started`` are in the log with the end, the engine's cache
    holds no more than the log, and the session takes the next generation."""
    engine = SpyEngine(eos_bias=-1000.0)
    rt = await Runtime.create(make_config(sqlite_url), engine=engine)
    try:
        sid = (await rt.open_session("t", eos_token_ids=[])).session_id
        await rt.append_text(sid, "abc")
        params = SamplingParams(max_tokens=8, seed=1)
        if how == "cancelled":
            engine.hold = asyncio.Event()

            async def caller() -> None:
                async for _ in rt.generate(sid, GenerateRequest(params, append=[80, 81])):
                    raise AssertionError("no run commits while the engine is held")

            task = asyncio.create_task(caller())
            for _ in range(100):
                if engine.histories:
                    break
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            engine.hold.set()
        else:
            engine.fail = True
            with pytest.raises(EngineError):
                async for _ in rt.generate(sid, GenerateRequest(params, append=[80, 81])):
                    raise AssertionError("nothing is shown before the first run commits")
        evs, state = await _settled(rt, sid)
        types = [e.type for e in evs]
        at = types.index(T.GENERATION_STARTED)
        assert types[at - 1] == T.TOKENS_APPENDED and evs[at - 1].body["tokens"] == [80, 81]
        fin = [e for e in evs if e.type == T.GENERATION_FINISHED]
        assert [f.body["finish_reason"] for f in fin] == [how]
        assert fin[0].body["completion_tokens"] == 0
        assert fin[0].body["prompt_tokens"] == state.length == evs[at].body["prompt_length"]
        assert (T.ERROR in types) == (how == "error")
        assert len({e.recorded_at for e in evs[at - 1 :]}) == 1  # one commit
        cached = rt.engine.cached_length(sid)
        assert cached is None or cached <= state.length
        engine.fail, engine.hold = False, None
        after = [
            e async for e in rt.generate(sid, GenerateRequest(SamplingParams(max_tokens=4, seed=2)))
        ]
        assert after[-1].body["finish_reason"] == "length"
        assert engine.histories[-1] == state.tokens.tolist()
    finally:
        await rt.aclose()


@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    history=st.lists(st.integers(0, 255), max_size=24),
    data=st.data(),
    append=st.lists(st.integers(0, 255), max_size=6),
    sink_window=st.one_of(st.none(), st.tuples(st.integers(0, 4), st.integers(1, 12))),
)
async def test_property_the_engine_starts_on_the_history_the_first_append_makes(
    sqlite_url: str,
    history: list[int],
    data: st.DataObject,
    append: list[int],
    sink_window: tuple[int, int] | None,
) -> None:
    """Whatever the first append holds (an append at an offset that rewinds, a
    sink+window truncation), the engine starts on the history the fold makes of it
    once it commits."""
    offset = data.draw(st.one_of(st.none(), st.integers(0, len(history))), label="offset")
    engine = SpyEngine(eos_bias=-1000.0)
    rt = await Runtime.create(make_config(sqlite_url), engine=engine)
    try:
        sid = (await rt.open_session("t", eos_token_ids=[])).session_id
        if history:
            await rt.append_tokens(sid, history)
        params = SamplingParams(max_tokens=2, seed=5)
        seen = [
            e
            async for e in rt.generate(
                sid,
                GenerateRequest(
                    params, append=append, offset=offset, truncating=True, sink_window=sink_window
                ),
            )
        ]
        state = await rt.sessions.load(sid)
        prompt = seen[[e.type for e in seen].index(T.GENERATION_STARTED)].body["prompt_length"]
        assert engine.histories == [state.tokens.tolist()[:prompt]]
        assert state.length == prompt + 2
    finally:
        with contextlib.suppress(Exception):
            await rt.aclose()
