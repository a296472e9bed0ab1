"""The Alembic revisions and the SQLAlchemy models describe the same schema."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from sessiontape.core.log import EventLog
from sessiontape.core.log.schema import metadata
from sessiontape.migrations.runner import current_revision


async def test_models_and_migrations_agree(db_url: str) -> None:
    log = await EventLog.open(db_url)
    try:
        async with log.engine.connect() as conn:
            diff = await conn.run_sync(
                lambda c: compare_metadata(MigrationContext.configure(c), metadata)
            )
            rev = await conn.run_sync(current_revision)
    finally:
        await log.close()
    assert diff == []
    assert rev == "0003_pg_append_data"


async def test_reopening_a_migrated_database_is_a_no_op(sqlite_url: str) -> None:
    for _ in range(2):
        log = await EventLog.open(sqlite_url)
        await log.close()
