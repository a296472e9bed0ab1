"""Reading the log back: SQLite's reader threads, blobs looked up in batches, and a
database that goes away and comes back."""

from __future__ import annotations

import asyncio
import hashlib
import os
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from sessiontape.core.errors import LogUnavailable
from sessiontape.core.events import NewEvent, T
from sessiontape.core.log import EventLog
from sessiontape.core.log.store import _BLOBS_PER_READ


def opened() -> NewEvent:
    return NewEvent(T.SESSION_OPENED, {"protocol": "test"})


@pytest.fixture
async def sqlite_log(sqlite_url: str) -> AsyncIterator[EventLog]:
    """A log on a SQLite file of its own (``tmp_path / "log.db"``), closed afterwards."""
    log = await EventLog.open(sqlite_url)
    try:
        yield log
    finally:
        await log.close()


async def test_a_read_with_more_blobs_than_one_lookup_takes_gets_each_its_own(
    db_url: str,
) -> None:
    log = await EventLog.open(db_url, inline_max_bytes=8)  # every payload below is a blob
    try:
        n = 2 * _BLOBS_PER_READ + 7
        payloads = [hashlib.sha256(str(i).encode()).digest() for i in range(n)]
        await log.append("s", 0, [opened()])
        # one payload twice: two events, one blob
        notes = [NewEvent(T.NOTE, {"i": i}, p) for i, p in enumerate([*payloads, payloads[3]])]
        await log.append("s", 1, notes)
        back = (await log.read("s"))[1:]
        assert [e.body["i"] for e in back] == list(range(n + 1))
        assert [e.data for e in back] == [*payloads, payloads[3]]
        assert [e.data for e in await log.read_all(0, limit=10_000, session_id="s")][1:] == [
            *payloads,
            payloads[3],
        ]
    finally:
        await log.close()


async def test_sqlite_reads_after_the_database_went_away_are_unavailable_then_recover(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "db"
    folder.mkdir()
    log = await EventLog.open(f"sqlite+aiosqlite:///{folder / 'log.db'}")
    try:
        first = await log.append("s", 0, [opened(), NewEvent(T.NOTE, {"k": 1})])
        assert await log.read("s") == first
        moved = tmp_path / "moved"
        os.rename(folder, moved)
        # what an unavailable error does: every reader connection is opened anew
        await log.dialect.reset_pool()
        with pytest.raises(LogUnavailable) as info:
            await log.read("s")
        assert "SELECT" not in info.value.message
        os.rename(moved, folder)
        assert await log.read("s") == first  # the readers connect again: nothing was lost
        more = await log.append("s", 2, [NewEvent(T.NOTE, {"k": 2})])
        assert await log.read("s") == first + more
    finally:
        await log.close()


async def test_sqlite_reads_see_each_commit_at_once(sqlite_log: EventLog) -> None:
    log = sqlite_log
    evs = await log.append("s", 0, [opened()])
    for k in range(50):  # read-your-writes on every reader thread's connection
        evs += await log.append("s", len(evs), [NewEvent(T.NOTE, {"k": k})])
        assert await log.read("s") == evs
        assert (await log.read_all(evs[-1].position - 1))[-1] == evs[-1]


async def test_sqlite_reads_hold_no_snapshot_that_would_keep_the_wal_from_a_checkpoint(
    sqlite_log: EventLog, tmp_path: Path
) -> None:
    log = sqlite_log
    evs = await log.append("s", 0, [opened()])
    for k in range(10):
        evs += await log.append("s", len(evs), [NewEvent(T.NOTE, {"k": k})])
        assert len(await log.read("s")) == len(evs)
    other = sqlite3.connect(tmp_path / "log.db", isolation_level=None)  # the fixture's file
    try:
        busy, _, _ = other.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    finally:
        other.close()
    assert busy == 0  # a reader that kept its read transaction open would block it


async def test_a_subscriber_from_the_logs_end_reads_nothing_back(sqlite_url: str) -> None:
    """On a log no process tails (SQLite), a subscriber from the log's end is live at
    once, with no catch-up read, and still gets the next commit: from a log written
    before this process opened it, and after another process (an import) wrote to it.
    One from an earlier position reads what it missed first."""
    first = await EventLog.open(sqlite_url)
    try:
        await first.append("s", 0, [opened(), NewEvent(T.NOTE, {"i": 0})])
    finally:
        await first.close()
    log = await EventLog.open(sqlite_url)
    other = await EventLog.open(sqlite_url)
    try:
        assert log.known_end() == await log.last_position() == 2
        reads: list[tuple[int, int, str | None]] = []
        real = log.subscriptions._read

        async def counted(after: int, limit: int, sid: str | None) -> Any:
            reads.append((after, limit, sid))
            return await real(after, limit, sid)

        log.subscriptions._read = counted  # type: ignore[method-assign]

        async def next_commit(after: int, version: int) -> list[int]:
            live = log.subscribe_batches(after, "s")
            waiting = asyncio.ensure_future(anext(live))
            await asyncio.sleep(0.05)  # the subscriber waits for the next commit
            await log.append("s", version, [NewEvent(T.NOTE, {"i": version})])
            got = [e.position for e in await asyncio.wait_for(waiting, 5)]
            await live.aclose()  # type: ignore[attr-defined]
            return got

        assert await next_commit(await log.last_position(), 2) == [3] and reads == []
        await other.append("s", 3, [NewEvent(T.NOTE, {"i": "other"})])  # position 4
        assert await log.last_position() == 4 and log.known_end() == 3
        assert await next_commit(await log.last_position(), 4) == [5] and reads == []
        # from an earlier position the subscriber reads what it missed first
        older = log.subscribe_batches(1, "s")
        assert [e.position for e in await asyncio.wait_for(anext(older), 5)] == [2, 3, 4, 5]
        await older.aclose()  # type: ignore[attr-defined]
        assert [r[0] for r in reads] == [1]
    finally:
        await other.close()
        await log.close()
