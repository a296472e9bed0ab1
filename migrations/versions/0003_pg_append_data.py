"""PostgreSQL: ``sessiontape_append`` also takes events that carry data.

Migration 0002's function inserts events without a ``data`` column, so a
batch holding one event with inline binary data (an Evergreen fragment, a
small image) took the writer's usual seven-statement transaction instead:
in a mixed fleet of 100 sessions, a third of the batches. This overload takes
two more arrays, each event's ``data`` and ``blob_sha`` (NULL for the events
without), and is otherwise the same. A batch with new blobs, new sessions or
a purge still takes the usual transaction.

0002's function stays: a batch without data still calls it (two arrays fewer
to send), as do servers of the previous release during a rolling upgrade.

SQLite: nothing to do (its writer commits in process).

Revision ID: 0003_pg_append_data
Revises: 0002_pg_append
Create Date: 2026-11-27
"""

from __future__ import annotations

from alembic import op

revision = "0003_pg_append_data"
down_revision = "0002_pg_append"
branch_labels = None
depends_on = None

FUNCTION = """
CREATE OR REPLACE FUNCTION sessiontape_append(
    p_lock bigint, p_start bigint, p_end bigint, p_channel text,
    e_position bigint[], e_session text[], e_version integer[], e_type text[],
    e_body text[], e_recorded double precision[], e_hash text[], e_prev text[],
    e_data bytea[], e_blob text[],
    u_id text[], u_count bigint[], u_version integer[], u_head text[],
    u_updated double precision[], u_active double precision[], u_status text[],
    u_history bigint[]
) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(p_lock);
    IF (SELECT COALESCE(MAX(position), 0) FROM events) <> p_start THEN
        RETURN false;
    END IF;
    INSERT INTO events (position, session_id, version, type, body, recorded_at, hash, prev_hash,
                        data, blob_sha)
        SELECT * FROM unnest(e_position, e_session, e_version, e_type, e_body, e_recorded,
                             e_hash, e_prev, e_data, e_blob);
    UPDATE sessions AS s SET
        version = COALESCE(u.version, s.version),
        head_hash = COALESCE(u.head, s.head_hash),
        updated_at = COALESCE(u.updated, s.updated_at),
        last_active_at = COALESCE(u.active, s.last_active_at),
        status = COALESCE(u.status, s.status),
        history_length = COALESCE(u.history, s.history_length),
        event_count = s.event_count + u.n
    FROM unnest(u_id, u_count, u_version, u_head, u_updated, u_active, u_status, u_history)
        AS u(id, n, version, head, updated, active, status, history)
    WHERE s.id = u.id;
    IF p_end > p_start THEN
        PERFORM pg_notify(p_channel, p_end::text);
    END IF;
    RETURN true;
END
$$
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(FUNCTION)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            "DROP FUNCTION IF EXISTS sessiontape_append(bigint, bigint, bigint, text, bigint[],"
            " text[], integer[], text[], text[], double precision[], text[], text[], bytea[],"
            " text[], text[], bigint[], integer[], text[], double precision[],"
            " double precision[], text[], bigint[])"
        )
