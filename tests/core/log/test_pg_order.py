"""PostgreSQL global order: a tailing reader never skips a late-committing event.

Two EventLog instances stand for two server processes sharing one database
(separate engines, separate connection pools); a third tails it. Writer A
holds its transaction open before COMMIT while writer B appends. With the
advisory lock around position assignment, B waits for A, so positions become
visible strictly in order and the tail sees every event exactly once.
"""

from __future__ import annotations

import asyncio

from sessiontape.core.events import NewEvent, T
from sessiontape.core.log import EventLog


def opened() -> NewEvent:
    return NewEvent(T.SESSION_OPENED, {"protocol": "test"})


async def test_delayed_commit_is_never_skipped(pg_url: str) -> None:
    a = await EventLog.open(pg_url, poll_interval_s=0.05)
    b = await EventLog.open(pg_url, poll_interval_s=0.05)
    tail = await EventLog.open(pg_url, poll_interval_s=0.05)
    try:
        await a.append("sa", 0, [opened()])
        await b.append("sb", 0, [opened()])
        seen: list[tuple[int, str]] = []

        async def follow() -> None:
            async for e in tail.subscribe(from_position=0):
                seen.append((e.position, e.session_id))
                if len(seen) == 4:
                    return

        follower = asyncio.create_task(follow())
        in_tx = asyncio.Event()
        release = asyncio.Event()

        async def slow_commit(_evs: object) -> None:
            in_tx.set()
            await release.wait()

        a.before_commit = slow_commit
        ta = asyncio.create_task(a.append("sa", 1, [NewEvent(T.NOTE, {"who": "a"})]))
        await asyncio.wait_for(in_tx.wait(), 5)
        tb = asyncio.create_task(b.append("sb", 1, [NewEvent(T.NOTE, {"who": "b"})]))
        await asyncio.sleep(0.5)
        # B cannot commit (or even take a position) while A holds the lock.
        assert not tb.done()
        assert [p for p, _ in seen] == [1, 2]
        a.before_commit = None
        release.set()
        [ea] = await asyncio.wait_for(ta, 5)
        [eb] = await asyncio.wait_for(tb, 5)
        await asyncio.wait_for(follower, 5)
        assert ea.position < eb.position
        assert seen == [(1, "sa"), (2, "sb"), (ea.position, "sa"), (eb.position, "sb")]
        assert [p for p, _ in seen] == [1, 2, 3, 4]
    finally:
        for lg in (a, b, tail):
            await lg.close()


async def test_cross_process_subscription_is_live(pg_url: str) -> None:
    # A 30 s poll: only LISTEN/NOTIFY can deliver within the 5 s below.
    writer = await EventLog.open(pg_url, poll_interval_s=30.0)
    reader = await EventLog.open(pg_url, poll_interval_s=30.0)
    try:
        got: list[int] = []

        async def follow() -> None:
            async for e in reader.subscribe(0, session_id="s"):
                got.append(e.version)
                if len(got) == 3:
                    return

        task = asyncio.create_task(follow())
        await writer.append("s", 0, [opened()])
        await writer.append("s", 1, [NewEvent(T.NOTE, {})])
        await writer.append("s", 2, [NewEvent(T.NOTE, {})])
        await asyncio.wait_for(task, 5)
        assert got == [1, 2, 3]
    finally:
        await writer.close()
        await reader.close()
