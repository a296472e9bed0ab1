"""PriorityGate: one holder at a time, lowest priority number first, FIFO within a priority."""

from __future__ import annotations

import asyncio

import pytest

from sessiontape.core.generation.scheduler import PriorityGate


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


class Holder:
    """Holds the gate until released, so the test decides when it hands over."""

    def __init__(self, gate: PriorityGate, order: list[str]) -> None:
        self.gate, self.order = gate, order
        self.release = asyncio.Event()

    async def run(self, name: str, priority: int) -> None:
        async with self.gate.slot(priority):
            self.order.append(name)
            await self.release.wait()


async def queue_behind_a_holder(gate: PriorityGate, waiters: list[tuple[str, int]]) -> list[str]:
    """Everyone in ``waiters`` queues (in list order) while another task holds the gate;
    returns the order in which they got it."""
    order: list[str] = []
    holder = Holder(gate, order)
    first = asyncio.create_task(holder.run("holder", 5))
    await settle()

    async def take(name: str, priority: int) -> None:
        async with gate.slot(priority):
            order.append(name)

    tasks = []
    for name, priority in waiters:
        tasks.append(asyncio.create_task(take(name, priority)))
        await settle()  # queued in this order
    holder.release.set()
    await asyncio.gather(first, *tasks)
    return order


async def test_a_free_gate_is_taken_at_once() -> None:
    gate = PriorityGate()
    async with gate.slot(10):
        assert not gate.waiting()
    async with gate.slot(0):
        pass


async def test_lowest_priority_number_goes_first() -> None:
    order = await queue_behind_a_holder(
        PriorityGate(), [("batch", 10), ("normal", 5), ("interactive", 0)]
    )
    assert order == ["holder", "interactive", "normal", "batch"]


async def test_fifo_within_a_priority() -> None:
    waiters = [("a", 3), ("b", 3), ("urgent", 1), ("c", 3), ("d", 3)]
    order = await queue_behind_a_holder(PriorityGate(), waiters)
    assert order == ["holder", "urgent", "a", "b", "c", "d"]


async def test_one_holder_at_a_time() -> None:
    gate = PriorityGate()
    inside, most = 0, 0

    async def step(priority: int) -> None:
        nonlocal inside, most
        async with gate.slot(priority):
            inside += 1
            most = max(most, inside)
            await asyncio.sleep(0)
            inside -= 1

    await asyncio.gather(*(step(i % 3) for i in range(30)))
    assert most == 1 and not gate.waiting()


async def test_a_cancelled_waiter_leaves_the_queue_and_the_next_one_gets_the_gate() -> None:
    gate = PriorityGate()
    order: list[str] = []
    holder = Holder(gate, order)
    first = asyncio.create_task(holder.run("holder", 0))
    await settle()

    async def take(name: str, priority: int) -> None:
        async with gate.slot(priority):
            order.append(name)

    doomed = asyncio.create_task(take("doomed", 0))
    await settle()
    later = asyncio.create_task(take("later", 5))
    await settle()
    doomed.cancel()
    with pytest.raises(asyncio.CancelledError):
        await doomed
    assert not gate.more_urgent_waiting(1)  # only "later" (5) is left in the queue
    holder.release.set()
    await asyncio.gather(first, later)
    assert order == ["holder", "later"]
    assert not gate.waiting()
    async with gate.slot(0):  # and the gate is free again
        pass


async def test_a_waiter_cancelled_as_it_is_handed_the_gate_passes_it_on() -> None:
    gate = PriorityGate()
    order: list[str] = []

    async def take(name: str) -> None:
        async with gate.slot(0):
            order.append(name)

    held = gate.slot(0)
    await held.__aenter__()
    handed = asyncio.create_task(take("handed"))
    await settle()
    nxt = asyncio.create_task(take("next"))
    await settle()
    await held.__aexit__(None, None, None)  # hands the gate to "handed", which has not run yet
    handed.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handed
    await asyncio.wait_for(nxt, 1.0)  # the gate went on instead of being lost
    assert order == ["next"]
    assert not gate.waiting()


async def test_more_urgent_waiting() -> None:
    gate = PriorityGate()
    order: list[str] = []
    holder = Holder(gate, order)
    first = asyncio.create_task(holder.run("holder", 5))
    await settle()
    assert not gate.more_urgent_waiting(5)  # nobody waits
    batch = asyncio.create_task(Holder(gate, order).run("batch", 10))
    await settle()
    assert gate.waiting()
    assert not gate.more_urgent_waiting(5)  # a less urgent waiter: keep the burst going
    assert not gate.more_urgent_waiting(10)  # an equal one: not more urgent
    interactive_holder = Holder(gate, order)
    interactive = asyncio.create_task(interactive_holder.run("interactive", 0))
    await settle()
    assert gate.more_urgent_waiting(5)  # hand over
    assert gate.more_urgent_waiting(1)
    assert not gate.more_urgent_waiting(0)
    holder.release.set()
    await first
    await settle()
    assert order == ["holder", "interactive"]
    interactive_holder.release.set()
    await interactive
    batch.cancel()
    with pytest.raises(asyncio.CancelledError):
        await batch
    assert not gate.waiting()
