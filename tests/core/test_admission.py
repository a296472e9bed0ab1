"""Admission: at most ``limit`` generations run at once, the others in priority then
arrival order; a generation gives its place up when it ends or after ``hold_s``
(core/generation/scheduler.py; docs/architecture.md, "Admission")."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from sessiontape.core import metrics
from sessiontape.core.engine.interface import SamplingParams
from sessiontape.core.events import T
from sessiontape.core.generation.request import GenerateRequest
from sessiontape.core.generation.scheduler import Admission
from sessiontape.core.runtime import Runtime
from sessiontape.engines.reference import ReferenceEngine
from tests.helpers.config import make_config


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


class Gen:
    """A stand-in generation: records when it starts, yields until told to end."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log
        self.end = asyncio.Event()
        self.closed = False

    async def runs(self) -> AsyncIterator[str]:
        self.log.append(f"start {self.name}")
        try:
            yield self.name
            await self.end.wait()
        finally:
            self.closed = True
            self.log.append(f"end {self.name}")


async def drive(adm: Admission, gen: Gen, priority: int = 0) -> None:
    async for _ in adm.admitted(gen.runs(), priority):
        pass


async def test_at_most_limit_run_and_the_rest_start_in_arrival_order() -> None:
    adm, log = Admission(2, hold_s=60), []
    gens = [Gen(n, log) for n in "abcde"]
    tasks = []
    for g in gens:
        tasks.append(asyncio.create_task(drive(adm, g)))
        await settle()
    assert log == ["start a", "start b"]
    assert adm.active == 2 and adm.waiting() == 3
    gens[1].end.set()
    await settle()
    assert log[-2:] == ["end b", "start c"]
    gens[0].end.set()
    await settle()
    assert log[-2:] == ["end a", "start d"]
    for g in gens:
        g.end.set()
    await asyncio.gather(*tasks)
    assert [e for e in log if e.startswith("start")] == [f"start {n}" for n in "abcde"]
    assert adm.active == 0 and adm.waiting() == 0


async def test_a_lower_priority_number_is_admitted_first() -> None:
    adm, log = Admission(1, hold_s=60), []
    first = Gen("first", log)
    t0 = asyncio.create_task(drive(adm, first))
    await settle()
    batch, interactive = Gen("batch", log), Gen("interactive", log)
    t1 = asyncio.create_task(drive(adm, batch, priority=10))
    await settle()
    t2 = asyncio.create_task(drive(adm, interactive, priority=0))
    await settle()
    first.end.set()
    await settle()
    assert log[-1] == "start interactive"
    interactive.end.set()
    batch.end.set()
    await asyncio.gather(t0, t1, t2)
    assert log.index("start interactive") < log.index("start batch")


async def test_a_generation_gives_its_place_up_after_hold_s_and_runs_on() -> None:
    adm, log = Admission(1, hold_s=0.02), []
    long, short = Gen("long", log), Gen("short", log)
    t0 = asyncio.create_task(drive(adm, long))
    await settle()
    t1 = asyncio.create_task(drive(adm, short))
    await settle()
    assert log == ["start long"]
    await asyncio.sleep(0.05)
    assert log == ["start long", "start short"]  # the long one still runs
    assert not long.closed
    short.end.set()
    long.end.set()
    await asyncio.gather(t0, t1)
    assert adm.active == 0


async def test_a_waiter_that_goes_away_leaves_no_place_taken() -> None:
    adm, log = Admission(1, hold_s=60), []
    holder, gone, next_ = Gen("holder", log), Gen("gone", log), Gen("next", log)
    t0 = asyncio.create_task(drive(adm, holder))
    await settle()
    t1 = asyncio.create_task(drive(adm, gone))
    t2 = asyncio.create_task(drive(adm, next_))
    await settle()
    assert metrics.GENERATIONS_WAITING._value.get() >= 2
    t1.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t1
    assert "start gone" not in log
    holder.end.set()
    await settle()
    assert log[-1] == "start next"
    next_.end.set()
    await asyncio.gather(t0, t2)
    assert adm.active == 0 and adm.waiting() == 0


async def test_no_limit_starts_everything_at_once() -> None:
    adm, log = Admission(0, hold_s=60), []
    gens = [Gen(str(i), log) for i in range(40)]
    tasks = [asyncio.create_task(drive(adm, g)) for g in gens]
    await settle()
    assert len([e for e in log if e.startswith("start")]) == 40
    for g in gens:
        g.end.set()
    await asyncio.gather(*tasks)


async def three_generations_at_once(
    sqlite_url: str, engine: ReferenceEngine
) -> tuple[Runtime, list[str], list[tuple[str, str]]]:
    """A runtime admitting one generation at a time and three sessions generating at
    once: the runtime, the sessions, and the generations' starts and finishes in log
    order."""
    cfg = make_config(sqlite_url, generation={"max_active": 1})
    rt = await Runtime.create(cfg, engine=engine)
    rt.generations.admission.hold_s = 60  # no hand-over by time in this test
    sids = [(await rt.open_session("t", eos_token_ids=[])).session_id for _ in range(3)]
    for sid in sids:
        await rt.append_text(sid, "abc")

    async def gen(sid: str) -> None:
        async for _ in rt.generate(sid, GenerateRequest(SamplingParams(max_tokens=12, seed=1))):
            pass

    await asyncio.gather(*(gen(s) for s in sids))
    evs = await rt.log.read_all(0, limit=10_000)
    ends = (T.GENERATION_STARTED, T.GENERATION_FINISHED)
    return rt, sids, [(e.session_id, e.type) for e in evs if e.type in ends]


async def test_the_runtime_admits_generations_one_at_a_time_with_a_limit_of_one(
    sqlite_url: str,
) -> None:
    engine = ReferenceEngine(eos_bias=-1000.0, step_delay_s=0.001)
    rt, sids, marks = await three_generations_at_once(sqlite_url, engine)
    try:
        # each generation started after the one before it finished, in arrival order
        assert marks == [
            (s, t) for s in sids for t in (T.GENERATION_STARTED, T.GENERATION_FINISHED)
        ]
        assert rt.generations.admission.active == 0
    finally:
        await rt.aclose()


class BatchingReference(ReferenceEngine):
    """The reference engine presenting itself as one that batches sessions per pass."""

    @property
    def batches(self) -> bool:
        return True


async def test_an_engine_that_batches_is_not_queued(sqlite_url: str) -> None:
    engine = BatchingReference(eos_bias=-1000.0, step_delay_s=0.002)
    rt, _, marks = await three_generations_at_once(sqlite_url, engine)
    try:
        # all three started before the first one finished
        assert [t for _, t in marks[:3]] == [T.GENERATION_STARTED] * 3
        assert rt.generations.admission.active == 0
    finally:
        await rt.aclose()
