"""The log's tables. Alembic revisions in migrations/ must agree with these
(tests/migrations/test_migrations.py checks it).

``events.position`` is assigned by the writer under the database's write lock
(SQLite's, or a transaction-scoped advisory lock on PostgreSQL), so positions
are gapless and commit in order: a tailing reader can never skip an event
that commits late (docs/architecture.md, "Global order").

``body`` is stored as canonical JSON text: the exact string that was hashed.
"""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

events = sa.Table(
    "events",
    metadata,
    # INTEGER on SQLite, where only that declaration makes the column the rowid (the
    # table's own key, not a second index of every event: migration 0004)
    sa.Column(
        "position",
        sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
        primary_key=True,
        autoincrement=False,
    ),
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

sessions = sa.Table(
    "sessions",
    metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("protocol", sa.String(32), nullable=False, server_default=""),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("label", sa.Text, nullable=False, server_default=""),
    sa.Column("engine", sa.String(64), nullable=False, server_default=""),
    sa.Column("model_id", sa.Text, nullable=False, server_default=""),
    sa.Column("parent_id", sa.String(64), nullable=True),
    sa.Column("parent_version", sa.Integer, nullable=True),
    sa.Column("fork_position", sa.BigInteger, nullable=True),
    sa.Column("created_at", sa.Float(precision=53), nullable=False),
    sa.Column("updated_at", sa.Float(precision=53), nullable=False),
    sa.Column("last_active_at", sa.Float(precision=53), nullable=False),
    sa.Column("ttl_s", sa.Float(precision=53), nullable=True),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("head_hash", sa.String(64), nullable=False),
    sa.Column("event_count", sa.BigInteger, nullable=False),
    sa.Column("history_length", sa.BigInteger, nullable=False, server_default="0"),
    sa.Index("ix_sessions_status_active", "status", "last_active_at"),
    sa.Index("ix_sessions_parent", "parent_id"),
    sa.Index("ix_sessions_created", "created_at"),
)

blobs = sa.Table(
    "blobs",
    metadata,
    sa.Column("sha256", sa.String(64), primary_key=True),
    sa.Column("size", sa.BigInteger, nullable=False),
    sa.Column("data", sa.LargeBinary, nullable=False),
    sa.Column("created_at", sa.Float(precision=53), nullable=False),
)

snapshots = sa.Table(
    "snapshots",
    metadata,
    sa.Column("session_id", sa.String(64), primary_key=True),
    sa.Column("version", sa.Integer, primary_key=True),
    sa.Column("state", sa.Text, nullable=False),
    sa.Column("data", sa.LargeBinary, nullable=True),
    sa.Column("created_at", sa.Float(precision=53), nullable=False),
)
