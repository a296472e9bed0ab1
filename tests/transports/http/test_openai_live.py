"""OpenAI streams take their turn's runs from the driving task (transports/http/openai/turns.py,
LiveRuns): each run once, in order, paced by the stream; the log covers whatever the
hand-over leaves out (a stop string, a stalled or departed stream)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from sessiontape.core.bodies import generated_token
from sessiontape.core.engine.interface import DEFAULT_OUTPUT, SamplingParams
from sessiontape.core.events import Event, T
from sessiontape.core.runtime import Runtime
from sessiontape.engines.reference import ReferenceEngine
from sessiontape.transports.http.openai.chat_template import ROLE_MARKERS
from sessiontape.transports.http.openai.turns import LiveRuns, Turns
from tests.helpers.config import make_config


def _run(n: int) -> list[Any]:
    return [n]


async def test_put_waits_until_the_stream_took_the_run() -> None:
    live = LiveRuns()
    put = asyncio.create_task(live.put(_run(1)))
    await asyncio.sleep(0.02)
    assert not put.done()  # nobody took it yet
    stream = live.stream()
    assert await anext(stream) == [1]
    await asyncio.wait_for(put, 1)
    second = asyncio.create_task(live.put(_run(2)))
    assert await anext(stream) == [2]
    await asyncio.wait_for(second, 1)
    live.end()
    assert [r async for r in stream] == []
    assert live.closed  # the stream ended: later puts return at once
    await asyncio.wait_for(live.put(_run(3)), 1)


async def test_runs_put_before_the_end_are_all_taken() -> None:
    live = LiveRuns()
    put = asyncio.create_task(live.put(_run(1)))
    await asyncio.sleep(0)
    live.end()
    assert [r async for r in live.stream()] == [[1]]
    await asyncio.wait_for(put, 1)


async def test_a_stalled_stream_closes_the_channel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(LiveRuns, "stalled_s", 0.05)
    live = LiveRuns()
    await asyncio.wait_for(live.put(_run(1)), 1)  # nobody took it: the driver goes on
    assert live.closed
    await asyncio.wait_for(live.put(_run(2)), 1)  # and no longer waits
    assert [r async for r in live.stream()] == []


async def test_a_stream_that_leaves_frees_the_driver() -> None:
    live = LiveRuns()
    stream = live.stream()
    put = asyncio.create_task(live.put(_run(1)))
    assert await anext(stream) == [1]
    second = asyncio.create_task(live.put(_run(2)))
    await asyncio.sleep(0.01)
    await stream.aclose()  # the client went away with run 2 untaken
    await asyncio.wait_for(asyncio.gather(put, second), 1)
    assert live.closed


@pytest.fixture
async def runtime(sqlite_url: str) -> AsyncIterator[Runtime]:
    rt = await Runtime.create(make_config(sqlite_url), engine=ReferenceEngine(eos_bias=-1000.0))
    try:
        yield rt
    finally:
        await rt.aclose()


def _ids(runs: list[list[Event]]) -> list[int]:
    return [int(t) for run in runs for e in run if (t := generated_token(e)) is not None]


async def _turn_runs(
    rt: Runtime, *, pause_after_first_s: float = 0.0, stop: list[str] | None = None
) -> tuple[list[list[Event]], list[int], str | None]:
    """A live turn of 200 tokens read through Turns.runs; what the stream got, the tokens the
    log holds for the generation, and its finish reason."""
    st = await rt.open_session("openai")
    tasks: set[asyncio.Task[Any]] = set()
    turns = Turns(rt, ROLE_MARKERS, tasks)
    request: dict[str, Any] = {"stop": stop or []}
    params = SamplingParams(max_tokens=200, temperature=0.0, seed=1)
    turn = await turns.start(
        st.session_id, "chat", [("user", "hi")], request, params, DEFAULT_OUTPUT, live=True
    )
    got: list[list[Event]] = []
    async for run in turns.runs(turn):
        got.append(run)
        if len(got) == 1 and pause_after_first_s:
            await asyncio.sleep(pause_after_first_s)
    await turns.wait(turn)
    gen = (await rt.get(st.session_id)).generations[turn.generation_id]
    return got, list(gen.tokens), gen.finish_reason


async def test_a_live_stream_gets_every_token_once_then_the_finish(runtime: Runtime) -> None:
    got, logged, reason = await _turn_runs(runtime)
    assert _ids(got) == logged and len(logged) == 200 and reason == "length"
    assert got[-1][-1].type == T.GENERATION_FINISHED
    versions = [e.version for run in got for e in run]
    assert versions == sorted(set(versions))  # in order, none twice


async def test_a_stalled_stream_continues_from_the_log(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stream sleeps past stalled_s after its first run: the driver finishes alone and the
    stream reads the rest from the log, every token once."""
    monkeypatch.setattr(LiveRuns, "stalled_s", 0.05)
    got, logged, reason = await _turn_runs(runtime, pause_after_first_s=0.3)
    assert _ids(got) == logged and len(logged) == 200 and reason == "length"
    assert got[-1][-1].type == T.GENERATION_FINISHED


async def test_a_stop_string_ends_the_driver_and_the_finish_comes_from_the_log(
    runtime: Runtime,
) -> None:
    """The driver stops at the stop string (the log says cancelled); the stream, whose
    hand-over ended without the finish, reads it from the log."""
    plain, _, _ = await _turn_runs(runtime)
    text = runtime.engine.detokenize(_ids(plain))
    stop = next(ch for ch in text[5:] if ch.isprintable() and ch != "\ufffd")
    got, logged, reason = await _turn_runs(runtime, stop=[stop])
    assert reason == "cancelled" and _ids(got) == logged and len(logged) < 200
    assert got[-1][-1].type == T.GENERATION_FINISHED
