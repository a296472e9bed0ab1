"""Loops over a whole session's history hand the event loop back as they go (core/handback.py).

Each test runs a history loop beside a ticker task that counts how often it
got the loop, and records the ticker's count at every step of the loop under
test (the fold, the decode, the document's apply). Run in one go, the count
would not move between the first step and the last; handed back every
``HANDBACK_EVERY`` steps, it moves at least once per block. What the loop
computes is compared with the same work done in one go.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from sessiontape.core import audit as audit_mod
from sessiontape.core.audit import audit_session
from sessiontape.core.document import DocumentBuilder
from sessiontape.core.engine.interface import SamplingParams
from sessiontape.core.generation.request import GenerateRequest
from sessiontape.core.handback import HANDBACK_EVERY, handing_back
from sessiontape.core.log import store as store_mod
from sessiontape.core.runtime import Runtime
from sessiontape.core.session import loader as loader_mod
from sessiontape.core.session.loader import load_state
from sessiontape.transports.http.native.feeds import Forks, load_builder


class Ticker:
    """A task that takes the event loop whenever it can, counting the times it got it."""

    def __init__(self) -> None:
        self.ticks = 0
        self.seen: list[int] = []  # the count at each step of the loop under test

    async def run(self) -> None:
        while True:
            self.ticks += 1
            await asyncio.sleep(0)

    def step(self) -> None:
        self.seen.append(self.ticks)

    def hand_backs(self) -> int:
        """How many times the count moved between two steps of the loop under test."""
        return sum(b > a for a, b in zip(self.seen, self.seen[1:], strict=False))


@contextlib.asynccontextmanager
async def ticking() -> AsyncIterator[Ticker]:
    t = Ticker()
    task = asyncio.create_task(t.run())
    await asyncio.sleep(0)
    try:
        yield t
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def spied(ticker: Ticker, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ticker.step()
        return fn(*args, **kwargs)

    return wrapper


async def test_handing_back_gives_the_loop_back_after_each_block_and_only_then() -> None:
    n = 3 * HANDBACK_EVERY + 17
    async with ticking() as t:
        got = []
        async for i in handing_back(range(n)):
            t.step()
            got.append(i)
    assert got == list(range(n))
    # the count moves exactly at the block boundaries, never inside a block
    moved_at = [i for i in range(1, n) if t.seen[i] > t.seen[i - 1]]
    assert moved_at == [HANDBACK_EVERY, 2 * HANDBACK_EVERY, 3 * HANDBACK_EVERY]


async def test_handing_back_a_short_loop_runs_it_in_one_go() -> None:
    async with ticking() as t:
        async for _ in handing_back(range(HANDBACK_EVERY - 1)):
            t.step()
    assert t.hand_backs() == 0


@pytest.fixture
async def long_session(runtime: Runtime) -> str:
    """A session of about 3 * HANDBACK_EVERY events."""
    sid = (await runtime.open_session("t", eos_token_ids=[])).session_id
    await runtime.append_text(sid, "a history long enough to hand the loop back")
    params = SamplingParams(max_tokens=3 * HANDBACK_EVERY, seed=5)
    async for _ in runtime.generate_runs(sid, GenerateRequest(params)):
        pass
    assert len(await runtime.reads.read_events(sid)) > 3 * HANDBACK_EVERY
    return sid


Case = Callable[[Runtime, str], Awaitable[Any]]


async def _document(rt: Runtime, sid: str) -> Any:
    return (await load_builder(rt, Forks(rt), sid)).doc


async def _read(rt: Runtime, sid: str) -> Any:
    return [e.hash for e in await rt.log.read(sid)]


async def _state(rt: Runtime, sid: str) -> Any:
    st = await load_state(rt.log, sid)
    return (st.version, st.tokens, st.head_hash)


async def _audit(rt: Runtime, sid: str) -> Any:
    return (await audit_session(rt, sid)).to_json()


CASES: dict[str, tuple[Case, Any, str]] = {
    # the loop under test: (its coroutine, the module, the name it calls once per event)
    "the document (GET, close, an SSE feed's start)": (_document, DocumentBuilder, "apply"),
    "reading the events back": (_read, store_mod, "parse_json"),
    "loading a session's state": (_state, loader_mod, "apply"),
    "auditing a session": (_audit, audit_mod, "apply"),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_a_history_loop_hands_the_loop_back_and_computes_the_same(
    runtime: Runtime, long_session: str, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    run, owner, name = CASES[case]
    # in one go first, for the result to compare with (the spy is not installed yet)
    expected = await run(runtime, long_session)
    events = len(await runtime.reads.read_events(long_session))
    async with ticking() as t:
        monkeypatch.setattr(owner, name, spied(t, getattr(owner, name)))
        got = await run(runtime, long_session)
    assert got == expected
    assert len(t.seen) >= events
    assert t.hand_backs() >= events // HANDBACK_EVERY - 1


async def test_the_document_built_handing_back_is_the_one_built_in_one_go(
    runtime: Runtime, long_session: str
) -> None:
    builder = DocumentBuilder(long_session, detokenize=runtime.engine.detokenize)
    for e in await runtime.reads.read_events(long_session):
        builder.apply(e)
    assert (await _document(runtime, long_session)) == builder.doc
    st = await load_state(runtime.log, long_session)
    folded = await runtime.sessions.load(long_session)
    assert (st.version, st.tokens) == (folded.version, folded.tokens)
