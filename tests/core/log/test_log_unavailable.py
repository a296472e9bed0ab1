"""A database that goes away: a typed, retryable LogUnavailable (503 / UNAVAILABLE), never
the driver's error with SQL in it, and the log recovers when the database is back."""

from __future__ import annotations

import asyncpg
import grpc
import pytest

from sessiontape.core.errors import LogUnavailable
from sessiontape.core.events import NewEvent, T
from sessiontape.core.log import EventLog
from sessiontape.transports.grpc.status import code_for
from sessiontape.transports.http.server.errors import to_response
from tests.helpers.config import PG_DB, PG_HOST, PG_PORT, PG_USER


async def terminate_backends(url: str) -> int:
    """Kill every connection to the database of ``url`` (what a restart or failover does)."""
    name = url.rsplit("/", 1)[1]
    admin = await asyncpg.connect(host=PG_HOST, port=PG_PORT, user=PG_USER, database=PG_DB)
    try:
        return len(
            await admin.fetch(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
                name,
            )
        )
    finally:
        await admin.close()


@pytest.mark.postgres
async def test_a_database_that_went_away_is_log_unavailable_then_recovers(pg_url: str) -> None:
    log = await EventLog.open(pg_url)
    try:
        await log.append("s1", 0, [NewEvent(T.SESSION_OPENED, {"protocol": "t"})])
        assert len(await log.read("s1")) == 1
        assert await terminate_backends(pg_url) >= 1
        with pytest.raises(LogUnavailable) as info:
            await log.read("s1")
        assert "SELECT" not in info.value.message and info.value.code == "log_unavailable"
        # the pool reconnects: reads and appends work again, nothing was lost
        assert len(await log.read("s1")) == 1
        await terminate_backends(pg_url)
        with pytest.raises(LogUnavailable):
            await log.append("s1", 1, [NewEvent(T.NOTE, {"text": "x"})])
        [opened] = await log.read("s1")  # the failed append wrote nothing
        await log.append("s1", 1, [NewEvent(T.NOTE, {"text": "x"})])
        assert [e.type for e in await log.read("s1")] == [opened.type, T.NOTE]
    finally:
        await log.close()


def test_every_wire_answers_log_unavailable_as_retryable() -> None:
    exc = LogUnavailable("the event log's database is unavailable (OperationalError); try again")
    resp = to_response(exc)
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    assert code_for(exc) == grpc.StatusCode.UNAVAILABLE
