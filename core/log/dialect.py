"""What differs between the log's databases, behind one small interface.

The writer (core/log/writer.py), the readers and the subscriptions
(core/log/store.py, core/log/subscriptions.py) are written once; everything
that depends on the database is a method of its :class:`Dialect`, one module per
database (core/log/sqlite.py, core/log/postgres.py; core/log/store.py's
``open_dialect`` picks one by URL). Each database is reached one way, its
dialect's own (docs/architecture.md, "Database access"):

- SQLite through the standard library's ``sqlite3``: every write (events,
  session index, snapshots) on the writer thread's connection, reads on the
  reader threads' connections (an in-memory database: on the writer's
  connection, on its thread); SQLAlchemy only for Alembic's migrations;
- PostgreSQL through SQLAlchemy's asyncpg engine (its pool, and asyncpg's own
  connections under it for the hot paths).

What else differs:

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

import hashlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError, IntegrityError, InterfaceError, OperationalError

log = logging.getLogger("sessiontape.log")

R = TypeVar("R")

#: work done inside a write transaction, on a DBAPI cursor
Work = Callable[[Any], R]
#: the test hook awaited inside the write transaction, just before COMMIT
Hook = Callable[[R], Awaitable[None]] | None
#: work done by Alembic (migrations, their revision), on a SQLAlchemy connection
Migration = Callable[[Connection], R]


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

    def __init__(self, url: str) -> None:
        #: the database's URL, as the log was opened with it
        self.url = url

    @abstractmethod
    def sql(self, text: str) -> str:
        """``text`` with ``?`` placeholders in the driver's own style."""

    @abstractmethod
    async def transaction(self, work: Work[R], before_commit: Hook[R], *, small: bool = False) -> R:
        """Run ``work(cursor)`` in one write transaction; COMMIT unless it raised.

        Work that assigns positions takes the position lock first
        (:meth:`lock_positions`). ``small``: the transaction carries one request (nothing else was
        waiting to be committed with it).
        """

    def transaction_now(self, work: Work[R]) -> R:
        """Run ``work(cursor)`` in one write transaction right here, on the loop's
        thread, without awaiting anything; COMMIT unless it raised.

        Raises :class:`NotNow` (nothing run) when that cannot be done without
        waiting: the dialect has no such path (PostgreSQL's driver is async), the
        writer's connection is not open yet or has work on the writer thread, or
        another connection holds the write lock.
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

    #: the driver's own exception classes for a uniqueness violation, and for a
    #: database that cannot be used now (beside SQLAlchemy's, raised by Alembic's runs)
    driver_conflicts: tuple[type[BaseException], ...] = ()
    driver_unavailable: tuple[type[BaseException], ...] = ()

    def is_conflict(self, exc: BaseException) -> bool:
        """Whether ``exc`` is a uniqueness violation (another writer took the version)."""
        return isinstance(exc, (IntegrityError, *self.driver_conflicts))

    def is_unavailable(self, exc: BaseException) -> bool:
        """Whether ``exc`` says the database cannot be used now (gone, unreachable, locked)."""
        return isinstance(
            exc, (OperationalError, InterfaceError, OSError, *self.driver_unavailable)
        ) or (isinstance(exc, DBAPIError) and exc.connection_invalidated)

    async def append_batch(self, args: Sequence[Any]) -> bool:
        """Commit a plain batch (event rows without data, session index updates) in
        one call (only where :attr:`one_call_append`; raises :class:`NotNow` elsewhere):
        True when it committed, False when the log moved on since the plan."""
        raise NotNow

    @abstractmethod
    async def fetch(self, sql: str, params: Sequence[Any]) -> list[Sequence[Any]]:
        """The rows of one read statement (``?`` placeholders), as the driver gives them."""

    @abstractmethod
    async def reset_pool(self) -> None:
        """After an unavailable error: drop pooled connections (all may be dead; the next
        use connects afresh) instead of handing each dead one out in turn."""

    @abstractmethod
    async def alembic(self, work: Migration[R]) -> R:
        """``work(connection)`` on a SQLAlchemy connection, in one transaction, one
        process at a time: Alembic's migrations and the revision they left (the one
        use of SQLAlchemy's engine on SQLite)."""

    async def listen(self, wake: Callable[[int | None], None]) -> None:  # noqa: B027
        """Call ``wake`` when a process commits, with the log's end after that commit
        when known (a hint; tailers also poll)."""

    async def try_lock_session(self, session_id: str) -> bool:
        """Take a session's cross-process writer lock; False when another process holds it."""
        return True

    async def unlock_session(self, session_id: str) -> None:  # noqa: B027
        """Release what :meth:`try_lock_session` took."""

    @abstractmethod
    async def close(self) -> None:
        """Close every connection (after the writer committed what was queued)."""
