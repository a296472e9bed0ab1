"""SQLite checkpoints run on their own thread, not inside the writer's commits."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path

from sessiontape.core.events import NewEvent, T
from sessiontape.core.log import EventLog
from sessiontape.core.log.checkpoint import BACKSTOP_PAGES
from sessiontape.core.log.sqlite import SQLiteDialect


def checkpoint_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "sessiontape-log-checkpoint"]


async def test_the_wal_is_copied_back_by_the_checkpoint_thread(tmp_path: Path) -> None:
    db = tmp_path / "log.db"
    log = await EventLog.open(f"sqlite+aiosqlite:///{db}")
    try:
        dialect = log.dialect
        assert isinstance(dialect, SQLiteDialect)
        await log.append("s", 0, [NewEvent(T.SESSION_OPENED, {"protocol": "test"})])
        cp = dialect.checkpointer
        assert cp is not None and len(checkpoint_threads()) == 1
        raw = dialect._raw
        assert raw is not None
        # the writer's own automatic checkpoint is only a backstop
        assert raw.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == BACKSTOP_PAGES
        # about 12 MB of events: three times SQLite's default automatic checkpoint
        v = 1
        for _ in range(60):
            await log.append(
                "s", v, [NewEvent(T.NOTE, {"text": "x" * 800, "k": k}) for k in range(200)]
            )
            v += 200
        assert cp.runs > 0
        # once the writes stop, the thread catches up (within its idle wait): every
        # frame in the WAL is back in the database, so a checkpoint made now (the
        # thread no longer running one) has nothing left to copy
        for _ in range(100):
            if cp.caught_up:
                break
            await asyncio.sleep(0.05)
        assert cp.caught_up
        with sqlite3.connect(db) as other:
            busy, frames, copied = other.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            assert busy == 0 and frames == copied
            assert other.execute("SELECT COUNT(*) FROM events").fetchone()[0] == v
    finally:
        await log.close()
    assert checkpoint_threads() == []  # closing the log stops the thread
    # everything committed is in the database, read back by a fresh open
    again = await EventLog.open(f"sqlite+aiosqlite:///{db}")
    try:
        assert len(await again.read("s")) == v
    finally:
        await again.close()
