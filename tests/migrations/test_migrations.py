"""The Alembic revisions and the SQLAlchemy models describe the same schema."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from sessiontape.core.engine.interface import SamplingParams
from sessiontape.core.events import NewEvent, T
from sessiontape.core.generation.request import GenerateRequest
from sessiontape.core.log import EventLog
from sessiontape.core.log.schema import metadata
from sessiontape.core.log.store import verify_chain
from sessiontape.core.runtime import Runtime
from sessiontape.engines.reference import ReferenceEngine
from sessiontape.migrations.runner import alembic_config
from tests.helpers.config import make_config


async def test_models_and_migrations_agree(db_url: str) -> None:
    log = await EventLog.open(db_url)
    try:
        diff = await log.dialect.alembic(
            lambda c: compare_metadata(MigrationContext.configure(c), metadata)
        )
        rev = await log.revision()
    finally:
        await log.close()
    assert diff == []
    assert rev == "0004_sqlite_position_rowid"


async def _downgrade(url: str, revision: str) -> None:
    """Alembic's downgrade to ``revision``, the one way the log runs Alembic."""
    log = await EventLog.open(url, migrate=False)
    try:
        await log.dialect.alembic(lambda c: command.downgrade(alembic_config(c), revision))
    finally:
        await log.close()


def _events_schema(path: str) -> tuple[str, list[str]]:
    with sqlite3.connect(path) as con:
        sql = con.execute("SELECT sql FROM sqlite_schema WHERE name = 'events'").fetchone()[0]
        indexes = [r[1] for r in con.execute("PRAGMA index_list(events)")]
    return sql, indexes


async def test_sqlite_events_are_kept_through_the_position_rowid_migration_both_ways(
    tmp_path: Path,
) -> None:
    """0004 rebuilds ``events`` with ``position`` as the rowid; down and up again, every
    event reads back the same and its chain holds, and the log appends on after it."""
    path = str(tmp_path / "m.db")
    url = f"sqlite+aiosqlite:///{path}"
    rt = await Runtime.create(make_config(url), engine=ReferenceEngine(eos_bias=-1000.0))
    sids = []
    try:
        for i in range(3):
            sid = (await rt.open_session("t")).session_id
            await rt.append_text(sid, f"session {i}")
            async for _ in rt.generate(sid, GenerateRequest(SamplingParams(max_tokens=20, seed=i))):
                pass
            sids.append(sid)
        before = {sid: await rt.log.read(sid) for sid in sids}
    finally:
        await rt.aclose()
    sql, indexes = _events_schema(path)
    assert "position INTEGER NOT NULL" in sql and len(indexes) == 1  # only (session_id, version)

    await _downgrade(url, "0003_pg_append_data")
    sql, indexes = _events_schema(path)
    assert "position BIGINT NOT NULL" in sql and len(indexes) == 2

    log = await EventLog.open(url)  # opening migrates to head again
    try:
        for sid in sids:
            after = await log.read(sid)
            assert after == before[sid]
            verify_chain(after)
        n = len(before[sids[0]])
        (ev,) = await log.append(sids[0], n, [NewEvent(T.ERROR, {"code": "x", "message": "m"})])
        assert ev.position == max(e.position for evs in before.values() for e in evs) + 1
    finally:
        await log.close()
    sql, indexes = _events_schema(path)
    assert "position INTEGER NOT NULL" in sql and len(indexes) == 1


@pytest.mark.parametrize("copied", [False, True])
async def test_a_position_rowid_rebuild_that_died_part_way_is_taken_up_again(
    tmp_path: Path, copied: bool
) -> None:
    """The driver runs the rebuild's statements one by one: a process that died after
    the rename (the new table empty, or already holding the copy) leaves the old table
    whole beside it, and the next start puts it back and rebuilds, every event kept."""
    path = str(tmp_path / "died.db")
    url = f"sqlite+aiosqlite:///{path}"
    log = await EventLog.open(url)
    await log.close()
    await _downgrade(url, "0003_pg_append_data")
    rows = [(p, "s_1", p, "t", "{}", None, None, 1.0, f"h{p}", f"h{p - 1}") for p in range(1, 40)]
    with sqlite3.connect(path) as con:
        con.executemany("INSERT INTO events VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
        # what a process killed inside 0004's upgrade leaves behind
        con.execute("ALTER TABLE events RENAME TO events_before_0004")
        con.execute(
            "CREATE TABLE events (position INTEGER NOT NULL, session_id VARCHAR(64) NOT NULL,"
            " version INTEGER NOT NULL, type VARCHAR(64) NOT NULL, body TEXT NOT NULL,"
            " data BLOB, blob_sha VARCHAR(64), recorded_at FLOAT NOT NULL,"
            " hash VARCHAR(64) NOT NULL, prev_hash VARCHAR(64) NOT NULL,"
            " PRIMARY KEY (position), UNIQUE (session_id, version))"
        )
        if copied:
            con.execute("INSERT INTO events SELECT * FROM events_before_0004")
    log = await EventLog.open(url)
    await log.close()
    with sqlite3.connect(path) as con:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_schema WHERE type='table'")}
        assert "events_before_0004" not in tables
        assert con.execute("SELECT * FROM events ORDER BY position").fetchall() == rows
        assert con.execute("SELECT version_num FROM alembic_version").fetchone() == (
            "0004_sqlite_position_rowid",
        )
    assert "position INTEGER NOT NULL" in _events_schema(path)[0]


async def test_reopening_a_migrated_database_is_a_no_op(sqlite_url: str) -> None:
    for _ in range(2):
        log = await EventLog.open(sqlite_url)
        await log.close()
