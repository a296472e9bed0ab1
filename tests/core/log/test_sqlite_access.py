"""SQLite reached one way, through the dialect's own sqlite3 connections: every write
(snapshots too) on the writer's connection, an in-memory database end to end, the
statements logged when asked."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from pathlib import Path

import pytest

from sessiontape.core.events import NewEvent, T
from sessiontape.core.log import EventLog
from sessiontape.core.log.store import verify_chain


def opened() -> NewEvent:
    return NewEvent(T.SESSION_OPENED, {"protocol": "test"})


def note(k: int, data: bytes | None = None) -> NewEvent:
    return NewEvent(T.NOTE, {"k": k}, data)


async def test_an_in_memory_database_is_migrated_written_and_read_on_one_connection() -> None:
    log = await EventLog.open("sqlite+aiosqlite:///:memory:", inline_max_bytes=16)
    try:
        assert await log.revision() == "0004_sqlite_position_rowid"
        live = log.subscribe(0)
        first = await log.append("a", 0, [opened(), note(1, b"x" * 100)])  # a blob
        now = log.append_now("a", 2, [note(2)])
        more = now if now is not None else await log.append("a", 2, [note(2)])
        other = await log.append("b", 0, [opened()])
        evs = first + more + other
        assert [e.position for e in evs] == [1, 2, 3, 4]
        assert await log.read("a") == first + more
        verify_chain(await log.read("a"))
        assert await log.read_all(0) == evs
        assert [await anext(live) for _ in evs] == evs
        assert await log.last_position() == 4
        assert [r.id for r in await log.list_sessions(newest_first=False)] == ["a", "b"]
        await log.save_snapshot("a", 3, '{"v": 3}', b"\x00")
        assert await log.load_snapshot("a") == (3, '{"v": 3}', b"\x00")
        tomb = await log.purge("a")
        assert [e.type for e in await log.read("a")] == [T.SESSION_PURGED] == [tomb.type]
        assert await log.load_snapshot("a") is None  # the purge took the snapshot with it
    finally:
        await log.close()


async def test_a_snapshot_waits_on_the_writer_thread_and_the_loop_does_not(
    sqlite_url: str, tmp_path: Path
) -> None:
    """A snapshot is a write of the writer's: while it waits there for another
    connection's write lock, an append does not try the writer's connection on the
    loop's thread (it queues), the loop runs on, and both land once the lock is free."""
    log = await EventLog.open(sqlite_url)
    other = sqlite3.connect(tmp_path / "log.db", isolation_level=None)
    try:
        await log.append("s", 0, [opened()])
        await log.append("s", 1, [note(1)])  # the writer is warm: it could commit inline
        other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
        snap = asyncio.ensure_future(log.save_snapshot("s", 2, '{"v": 2}', None))
        await asyncio.sleep(0.1)
        assert not snap.done()
        assert log.append_now("s", 2, [note(2)]) is None  # not inline: it would wait
        queued = asyncio.ensure_future(log.append("s", 2, [note(2)]))
        await asyncio.sleep(0.1)  # the loop is free meanwhile
        assert not queued.done()
        other.execute("COMMIT")
        await asyncio.wait_for(asyncio.gather(snap, queued), 10)
        assert await log.load_snapshot("s") == (2, '{"v": 2}', None)
        assert [e.version for e in await log.read("s")] == [1, 2, 3]
    finally:
        other.close()
        await log.close()


async def test_echo_logs_each_statement(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="sessiontape.log.sql")
    log = await EventLog.open("sqlite+aiosqlite:///:memory:", echo=True)
    try:
        await log.append("s", 0, [opened()])
        await log.read("s")
    finally:
        await log.close()
    statements = [r.getMessage() for r in caplog.records if r.name == "sessiontape.log.sql"]
    assert any(s.startswith("INSERT INTO events") for s in statements)
    assert any(s.startswith("SELECT position") for s in statements)
