"""PostgreSQL's one-call append (``sessiontape_append``, migration 0002) and its tail.

Two EventLog instances stand for two server processes on one database. A plan
made from one writer's cache commits in one call while the log ends where the
plan assumed; when the other process wrote meanwhile, nothing of it is written
and the batch is planned again inside an ordinary transaction. Either way the
log stays dense and hash-chained, and a tailer sees every event once, in order,
its own process's commits handed over without reading them back.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any

import pytest

from sessiontape.core.events import Event, NewEvent, T
from sessiontape.core.log import EventLog
from tests.helpers.config import requires_pg

pytestmark = [pytest.mark.postgres, requires_pg]


def opened() -> NewEvent:
    return NewEvent(T.SESSION_OPENED, {"protocol": "test"})


def note(text: str) -> NewEvent:
    return NewEvent(T.NOTE, {"text": text})


@pytest.fixture
async def pair(pg_url: str) -> AsyncIterator[tuple[EventLog, EventLog]]:
    a = await EventLog.open(pg_url, poll_interval_s=0.05)
    b = await EventLog.open(pg_url, poll_interval_s=0.05)
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()


def spy_calls(log: EventLog) -> list[bool | None]:
    """What each append_batch call answered (True: committed in one call)."""
    answers: list[bool | None] = []
    dialect: Any = log.writer.dialect
    real = dialect.append_batch

    async def spied(args: Any) -> bool | None:
        done = await real(args)
        answers.append(done)
        return done  # type: ignore[no-any-return]

    dialect.append_batch = spied
    return answers


def check_dense_and_chained(evs: list[Event]) -> None:
    assert [e.position for e in evs] == list(range(1, len(evs) + 1))
    by_session: dict[str, list[Event]] = {}
    for e in evs:
        by_session.setdefault(e.session_id, []).append(e)
    for sid_evs in by_session.values():
        assert [e.version for e in sid_evs] == list(range(1, len(sid_evs) + 1))
        for prev, e in itertools.pairwise(sid_evs):
            assert e.prev_hash == prev.hash


async def test_a_plan_from_the_cache_commits_in_one_call(pair: tuple[EventLog, EventLog]) -> None:
    a, _ = pair
    answers = spy_calls(a)
    await a.append("s", 0, [opened()])
    for v in range(1, 6):
        await a.append("s", v, [note(f"n{v}")])
    # the first append planned inside its transaction (nothing cached yet); the rest
    # were planned ahead and each committed in one call
    assert answers and all(answers)
    assert len(answers) >= 4
    check_dense_and_chained(await a.read_all(0, limit=100))


async def test_events_with_data_commit_in_one_call_beside_events_without(
    pair: tuple[EventLog, EventLog],
) -> None:
    a, _ = pair
    await a.append("s", 0, [opened()])
    await a.append("t", 0, [opened()])
    answers = spy_calls(a)
    small = bytes(range(256)) * 3  # inline: under the log's inline_max_bytes
    big = b"\x00\xff" * a.inline_max_bytes  # over it: a blob, the usual transaction
    # appends queued together share a batch: rows with and without data in one call
    await asyncio.gather(
        a.append("s", 1, [NewEvent(T.NOTE, {"text": "with data"}, small), note("plain")]),
        a.append("t", 1, [note("plain too"), NewEvent(T.NOTE, {"text": "empty"}, b"")]),
    )
    assert answers and all(answers)
    calls = len(answers)
    await a.append("s", 3, [NewEvent(T.NOTE, {"text": "a blob"}, big)])
    assert len(answers) == calls  # planned with a new blob: not one call
    [e] = await a.append("s", 4, [NewEvent(T.NOTE, {"text": "after"}, small[:5])])
    assert len(answers) == calls + 1 and answers[-1]
    evs = await a.read_all(0, limit=100)
    check_dense_and_chained(evs)
    data = {(x.session_id, x.body.get("text")): x.data for x in evs}
    assert data[("s", "with data")] == small
    assert data[("s", "plain")] is None
    assert data[("t", "plain too")] is None
    assert data[("t", "empty")] == b""
    assert data[("s", "a blob")] == big
    assert data[("s", "after")] == small[:5]
    # what was read back hashes as what was committed
    from sessiontape.core.log.store import verify_chain

    for sid in ("s", "t"):
        verify_chain(await a.read(sid))
    assert e.hash == (await a.read("s"))[-1].hash


async def test_another_process_writing_makes_the_plan_start_again(
    pair: tuple[EventLog, EventLog],
) -> None:
    a, b = pair
    answers = spy_calls(a)
    await a.append("s", 0, [opened()])
    await a.append("s", 1, [note("a1")])
    await b.append("t", 0, [opened()])  # the log moves on behind a's cache
    await b.append("s", 2, [note("b on s")])  # ... and so does a's session
    # a's cached head of s is stale: its plan is refused, nothing written, and the
    # append meets the version conflict inside its transaction
    from sessiontape.core.errors import ConcurrencyError

    with pytest.raises(ConcurrencyError):
        await a.append("s", 2, [note("a2, stale")])
    assert False in answers
    # with the right version it commits, planned again from the database
    [e] = await a.append("s", 3, [note("a3")])
    assert e.version == 4
    evs = await a.read_all(0, limit=100)
    check_dense_and_chained(evs)
    assert [x.body.get("text") for x in evs if x.session_id == "s"][1:] == ["a1", "b on s", "a3"]


async def test_a_tailer_sees_both_processes_events_once_in_order(
    pair: tuple[EventLog, EventLog],
) -> None:
    a, b = pair
    await a.append("sa", 0, [opened()])
    await b.append("sb", 0, [opened()])
    seen: list[int] = []
    total = 2 + 2 * 20

    async def follow() -> None:
        async for e in a.subscribe(from_position=0):
            seen.append(e.position)
            if len(seen) == total:
                return

    follower = asyncio.create_task(follow())

    async def write(log: EventLog, sid: str) -> None:
        for v in range(1, 21):
            await log.append(sid, v, [note(f"{sid}{v}")])
            if v % 3 == 0:
                await asyncio.sleep(0)

    await asyncio.wait_for(asyncio.gather(write(a, "sa"), write(b, "sb")), 30)
    await asyncio.wait_for(follower, 10)
    assert seen == list(range(1, total + 1))
    check_dense_and_chained(await a.read_all(0, limit=100))
