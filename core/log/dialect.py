"""What differs between the log's databases, behind one small interface.

The writer (core/log/writer.py), the readers and the subscriptions
(core/log/store.py, core/log/subscriptions.py) are written once; everything
that depends on the database is a method of its :class:`Dialect`, one module per
database (core/log/sqlite.py, core/log/postgres.py; core/log/store.py's
``open_dialect`` picks one by URL):

- how a write transaction runs: SQLite in the writer's own thread on its own
  ``sqlite3`` connection (``BEGIN IMMEDIATE`` takes the write lock, so
  positions are read and assigned under it; one thread hop per commit),
  PostgreSQL through ``run_sync`` on an asyncpg connection with a
  transaction-scoped advisory lock around position assignment;
- placeholders (``?`` or ``$n``) for the plain SQL of the hot paths;
- whether other processes write to the database (``shared``: replicas on
  PostgreSQL), and so whether subscriptions tail the database and
  generations take a cross-process writer lock (a session-level advisory
  lock);
- the wake-up hint for tailers (LISTEN/NOTIFY on PostgreSQL) and the lock
  that serializes migrations of servers starting together.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import sqlite3
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from sqlalchemy.exc import DBAPIError, IntegrityError, InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

log = logging.getLogger("sessiontape.log")

R = TypeVar("R")

#: work done inside a write transaction, on a DBAPI cursor
Work = Callable[[Any], R]
#: the test hook awaited inside the write transaction, just before COMMIT
Hook = Callable[[R], Awaitable[None]] | None


class NotNow(Exception):
    """A transaction asked for right away cannot be had without waiting (another
    connection holds SQLite's write lock, or the dialect has no such path)."""


def session_lock_key(session_id: str) -> int:
    """The 64-bit advisory-lock key of a session's writer lock."""
    return int.from_bytes(
        hashlib.sha256(b"sessiontape-writer:" + session_id.encode()).digest()[:8],
        "big",
        signed=True,
    )


class Dialect(ABC):
    """One database's way of doing what the log needs."""

    #: other processes may write to the database (several servers share it)
    shared: bool = False
    #: :meth:`append_batch` commits a plain batch in one call
    one_call_append: bool = False

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    @abstractmethod
    def sql(self, text: str) -> str:
        """``text`` with ``?`` placeholders in the driver's own style."""

    @abstractmethod
    async def transaction(self, work: Work[R], before_commit: Hook[R], *, small: bool = False) -> R:
        """Run ``work(cursor)`` in one write transaction; COMMIT unless it raised.

        ``work`` must take the position lock first (:meth:`lock_positions`).
        ``small``: the transaction carries one request (nothing else was
        waiting to be committed with it).
        """

    def transaction_now(self, work: Work[R]) -> R:
        """Run ``work(cursor)`` in one write transaction right here, on the loop's
        thread, without awaiting anything; COMMIT unless it raised.

        Raises :class:`NotNow` (nothing run) when that cannot be done without
        waiting: the dialect has no such path (PostgreSQL's driver is async), the
        writer's connection is not open yet, or another connection holds the
        write lock.
        """
        raise NotNow

    def insert_rows(
        self, cur: Any, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]
    ) -> None:
        """Inside a write transaction: insert ``rows`` (one value per column each)."""
        marks = ", ".join("?" * len(columns))
        cur.executemany(
            self.sql(f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks})"), rows
        )

    def lock_positions(self, cur: Any) -> None:  # noqa: B027
        """Inside a write transaction: serialize position assignment with every other writer."""

    def notify(self, cur: Any, position: int) -> None:  # noqa: B027
        """Inside a write transaction: wake other processes' tailers once it commits."""

    def is_conflict(self, exc: BaseException) -> bool:
        """Whether ``exc`` is a uniqueness violation (another writer took the version)."""
        dbapi = self.engine.dialect.dbapi
        return isinstance(exc, IntegrityError | sqlite3.IntegrityError) or (
            dbapi is not None and isinstance(exc, dbapi.IntegrityError)
        )

    def is_unavailable(self, exc: BaseException) -> bool:
        """Whether ``exc`` says the database cannot be used now (gone, unreachable, locked)."""
        dbapi = self.engine.dialect.dbapi
        kinds: tuple[type[BaseException], ...] = (
            OperationalError,
            InterfaceError,
            sqlite3.OperationalError,
            OSError,
        )
        if dbapi is not None:
            # InternalError too: asyncpg reports a connection the server terminated
            # mid-protocol as an InternalClientError ("another operation is in progress")
            kinds += tuple(
                k
                for k in (
                    getattr(dbapi, name, None)
                    for name in ("OperationalError", "InterfaceError", "InternalError")
                )
                if isinstance(k, type)
            )
        return isinstance(exc, kinds) or (
            isinstance(exc, DBAPIError) and exc.connection_invalidated
        )

    async def append_batch(self, args: Sequence[Any]) -> bool:
        """Commit a plain batch (event rows without data, session index updates) in
        one call (only where :attr:`one_call_append`; raises :class:`NotNow` elsewhere):
        True when it committed, False when the log moved on since the plan."""
        raise NotNow

    async def fetch(self, sql: str, params: Sequence[Any]) -> list[Sequence[Any]]:
        """The rows of one read statement (``?`` placeholders), as the driver gives them.

        Through SQLAlchemy here; a dialect with a cheaper way to its driver overrides it.
        """
        async with self.engine.connect() as conn:
            return list((await conn.exec_driver_sql(self.sql(sql), tuple(params))).all())

    async def reset_pool(self) -> None:
        """After an unavailable error: drop pooled connections (all may be dead; the next
        use connects afresh) instead of handing each dead one out in turn."""
        await self.engine.dispose(close=False)

    async def migration_lock(self, conn: AsyncConnection) -> None:  # noqa: B027
        """Inside the migration transaction: one server migrates at a time."""

    async def listen(self, wake: Callable[[int | None], None]) -> None:  # noqa: B027
        """Call ``wake`` when a process commits, with the log's end after that commit
        when known (a hint; tailers also poll)."""

    async def try_lock_session(self, session_id: str) -> bool:
        """Take a session's cross-process writer lock; False when another process holds it."""
        return True

    async def unlock_session(self, session_id: str) -> None:  # noqa: B027
        """Release what :meth:`try_lock_session` took."""

    async def close(self) -> None:
        await self.engine.dispose()
        await settle_terminations()


async def settle_terminations(timeout_s: float = 2.0) -> None:
    """Wait for SQLAlchemy's graceful closes of connections invalidated by a cancel.

    A read cancelled mid-query (a stream cut at shutdown) invalidates its
    connection, and the asyncio adapters close it in a shielded task nobody
    awaits; if the loop ends first, asyncio reports "Task was destroyed but
    it is pending". Closing the log waits for them.
    """
    me = asyncio.current_task()
    pending = [
        t
        for t in asyncio.all_tasks()
        if t is not me
        and not t.done()
        and getattr(t.get_coro(), "__qualname__", "").endswith("_terminate_graceful_close")
    ]
    if pending:
        await asyncio.wait(pending, timeout=timeout_s)
