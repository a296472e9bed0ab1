"""Initial schema: events, sessions, blobs, snapshots.

Revision ID: 0001_initial
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001_initial"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "events",
        sa.Column("position", sa.BigInteger, primary_key=True, autoincrement=False),
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
    op.create_table(
        "sessions",
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
    )
    op.create_index("ix_sessions_status_active", "sessions", ["status", "last_active_at"])
    op.create_index("ix_sessions_parent", "sessions", ["parent_id"])
    op.create_index("ix_sessions_created", "sessions", ["created_at"])
    op.create_table(
        "blobs",
        sa.Column("sha256", sa.String(64), primary_key=True),
        sa.Column("size", sa.BigInteger, nullable=False),
        sa.Column("data", sa.LargeBinary, nullable=False),
        sa.Column("created_at", sa.Float(precision=53), nullable=False),
    )
    op.create_table(
        "snapshots",
        sa.Column("session_id", sa.String(64), primary_key=True),
        sa.Column("version", sa.Integer, primary_key=True),
        sa.Column("state", sa.Text, nullable=False),
        sa.Column("data", sa.LargeBinary, nullable=True),
        sa.Column("created_at", sa.Float(precision=53), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("snapshots")
    op.drop_table("blobs")
    op.drop_index("ix_sessions_created", "sessions")
    op.drop_index("ix_sessions_parent", "sessions")
    op.drop_index("ix_sessions_status_active", "sessions")
    op.drop_table("sessions")
    op.drop_table("events")
