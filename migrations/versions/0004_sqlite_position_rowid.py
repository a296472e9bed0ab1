"""SQLite: ``events.position`` is the table's rowid.

SQLite makes a column its rowid only when it is declared exactly ``INTEGER
PRIMARY KEY``. ``position`` was ``BIGINT``, so each event was stored twice over:
once in the table (keyed by a hidden rowid) and once in an index of its
position. Every append wrote both B-trees: 1.5 of the 9.3 pages a short turn's
commit wrote to the WAL were that index's, and every row cost an index insert. As
the rowid, ``position`` is the table's own key: a read from a position is a range of the table, the
log's end is its last row, and the index is gone.

The table is rebuilt: renamed, created anew, its rows copied in position order,
the old one dropped; a one-time copy of the log, at the first start of this
release on an existing database (seconds for a million events; the file grows by the old table's size, whose pages stay free in it for later
appends until a ``VACUUM``). The driver runs those statements one by one
(SQLite's Python driver opens no transaction for DDL), so a process that dies
part way leaves the old table, whole, beside a new one: the next attempt puts
the old one back first and starts again (:func:`_resume`). The columns, their
values and the unique ``(session_id, version)`` constraint are unchanged;
SQLite stores an ``INTEGER`` in the same 64 bits a ``BIGINT`` had.

PostgreSQL: nothing to do (``bigint`` there, and a table is not keyed by a rowid).

Revision ID: 0004_sqlite_position_rowid
Revises: 0003_pg_append_data
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_sqlite_position_rowid"
down_revision = "0003_pg_append_data"
branch_labels = None
depends_on = None

COLUMNS = "position, session_id, version, type, body, data, blob_sha, recorded_at, hash, prev_hash"
#: the table being rebuilt, while it is: always whole (a rename is atomic)
OLD = "events_before_0004"


def _resume() -> None:
    """After a rebuild that stopped part way, the old table again as ``events``."""
    names = set(sa.inspect(op.get_bind()).get_table_names())
    if OLD in names:
        if "events" in names:
            op.drop_table("events")  # the new one, empty or part copied
        op.rename_table(OLD, "events")


def _rebuild(position: sa.types.TypeEngine[int]) -> None:
    """``events`` again with ``position`` of type ``position``, every row kept."""
    _resume()
    op.rename_table("events", OLD)
    op.create_table(
        "events",
        sa.Column("position", position, primary_key=True, autoincrement=False),
        sa.Column("session_id", sa.String(64), nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("type", sa.String(64), nullable=False),
        sa.Column("body", sa.Text, nullable=False),
        sa.Column("data", sa.LargeBinary, nullable=True),
        sa.Column("blob_sha", sa.String(64), nullable=True),
        sa.Column("recorded_at", sa.Float(precision=53), nullable=False),
        sa.Column("hash", sa.String(64), nullable=False),
        sa.Column("prev_hash", sa.String(64), nullable=False),
        sa.UniqueConstraint("session_id", "version", name="uq_events_session_version"),
    )
    op.execute(f"INSERT INTO events ({COLUMNS}) SELECT {COLUMNS} FROM {OLD} ORDER BY position")
    op.drop_table(OLD)


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        _rebuild(sa.Integer())


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        _rebuild(sa.BigInteger())
