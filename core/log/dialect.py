"""What differs between the log's databases, behind one small interface.

The writer (core/log/writer.py), the readers and the subscriptions
(core/log/store.py, core/log/subscriptions.py) are written once; everything
that depends on the database is a method of its :class:`Dialect`:

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
import contextlib
import hashlib
import itertools
import logging
import sqlite3
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import event as sa_event
from sqlalchemy.exc import DBAPIError, IntegrityError, InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.util import await_only

from sessiontape.core.log.checkpoint import BACKSTOP_PAGES, Checkpointer

log = logging.getLogger("sessiontape.log")

R = TypeVar("R")

PG_LOCK_KEY = 0x5E55_1074  # transaction-scoped advisory lock around position assignment
PG_CHANNEL = "sessiontape_events"
PG_MIGRATE_KEY = 0x5E55_1075

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

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    @staticmethod
    def open(url: str, *, echo: bool = False, sqlite_synchronous: str = "NORMAL") -> Dialect:
        """The dialect of ``url``, with its SQLAlchemy engine."""
        if url.startswith("sqlite"):
            return SQLiteDialect(url, echo=echo, synchronous=sqlite_synchronous)
        engine = create_async_engine(url, echo=echo)
        if engine.dialect.name == "postgresql":
            return PostgresDialect(engine)
        raise ValueError(f"unsupported database {engine.dialect.name!r} (SQLite or PostgreSQL)")

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

    async def append_batch(self, args: Sequence[Any]) -> bool | None:
        """Commit a plain batch (event rows without data, session index updates) in
        one call, when the dialect has such a path; None when it has not."""
        return None

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


#: the most rows one multi-row INSERT carries on SQLite (a power of two)
ROWS_PER_INSERT = 1024


class SQLiteDialect(Dialect):
    """SQLite in WAL mode: one server process writes; others (the CLI) read."""

    def __init__(self, url: str, *, echo: bool, synchronous: str) -> None:
        super().__init__(create_async_engine(url, echo=echo, connect_args={"timeout": 30}))
        self.synchronous = synchronous
        sa_event.listen(self.engine.sync_engine, "connect", self._pragmas)
        self.path = self.engine.url.database or ":memory:"
        #: the writer's own connection, used only from the writer thread
        self._raw: sqlite3.Connection | None = None
        #: whether ``_raw``'s busy timeout is 0 now (an inline try) rather than 30 s
        self._nowait = False
        self._thread = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="sessiontape-log-writer"
        )
        #: multi-row INSERT texts by (prefix, rows); SQLite's bound-variable limit
        self._insert_sql: dict[tuple[str, int], str] = {}
        self._variable_limit: int | None = None
        #: checkpoints on a thread of their own (a file database; started with the writer)
        self.checkpointer: Checkpointer | None = None

    def _pragmas(self, dbapi_conn: Any, _rec: Any = None) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA synchronous={self.synchronous}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    def sql(self, text: str) -> str:
        return text

    async def transaction(self, work: Work[R], before_commit: Hook[R], *, small: bool = False) -> R:
        loop = asyncio.get_running_loop()
        if small and before_commit is None and self._raw is not None:
            # One request alone: a WAL commit without fsync takes less than handing
            # it to the writer thread and back (two GIL hand-offs and several loop
            # turns), so try it right here, unless another connection holds the
            # write lock, which the writer thread then waits for instead (the loop
            # never waits on it). Larger batches go to the thread, where SQLite's
            # work overlaps the loop's.
            try:
                return self._transaction(loop, work, None, wait=False)
            except NotNow:
                pass
        return await loop.run_in_executor(
            self._thread, self._transaction, loop, work, before_commit
        )

    def transaction_now(self, work: Work[R]) -> R:
        if self._raw is None:
            raise NotNow
        return self._transaction(asyncio.get_running_loop(), work, None, wait=False)

    def _transaction(
        self,
        loop: asyncio.AbstractEventLoop,
        work: Work[R],
        before_commit: Hook[R],
        wait: bool = True,
    ) -> R:
        raw = self._raw
        if raw is None:
            raw = self._raw = sqlite3.connect(
                self.path, timeout=30, isolation_level=None, check_same_thread=False
            )
            self._pragmas(raw)
            self._nowait = False  # connect's timeout: 30 s
            if self.path not in ("", ":memory:") and self.checkpointer is None:
                # checkpoints run on the checkpoint thread, not inside this
                # connection's commits; its own automatic one is only a backstop
                raw.execute(f"PRAGMA wal_autocheckpoint={BACKSTOP_PAGES}")
                self.checkpointer = Checkpointer(self.path, self.synchronous)
        # IMMEDIATE takes the write lock now: positions are read and assigned under it.
        # An inline try must not wait for another connection's lock (the loop would
        # block on it): its busy timeout is 0, set only when the mode changes, since
        # consecutive inline commits (one generation's runs) would pay two statements each.
        if self._nowait != (not wait):
            raw.execute(f"PRAGMA busy_timeout = {0 if not wait else 30000}")
            self._nowait = not wait
        if wait:
            raw.execute("BEGIN IMMEDIATE")
        else:
            try:
                raw.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as exc:
                if "locked" in str(exc) or "busy" in str(exc):
                    raise NotNow from exc
                raise
        try:
            result = work(raw.cursor())
            if before_commit is not None:  # run the hook on the loop and wait for it
                asyncio.run_coroutine_threadsafe(before_commit(result), loop).result()  # type: ignore[arg-type]
            raw.execute("COMMIT")
        except BaseException:
            if raw.in_transaction:
                raw.execute("ROLLBACK")
            raise
        if self.checkpointer is not None:
            self.checkpointer.committed(raw.total_changes)
        return result

    def insert_rows(
        self, cur: Any, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]
    ) -> None:
        """Multi-row INSERTs of up to :data:`ROWS_PER_INSERT` rows each.

        ``executemany`` steps SQLite once per row and takes the GIL back after
        every step: while the event loop's thread runs Python, the writer
        thread then waits up to the interpreter's switch interval (5 ms) for
        each row. One statement of many rows binds them all, then runs in one
        step with the GIL released throughout, so SQLite's work overlaps the
        loop's instead of queueing behind it (and it is no slower alone). The
        rows of a batch are split into power-of-two statements, so at most a
        dozen statement texts exist and all stay in the prepared cache.
        """
        n = len(columns)
        prefix = f"INSERT INTO {table} ({', '.join(columns)}) VALUES "
        group = "(" + ", ".join("?" * n) + ")"
        size = self._rows_per_insert(cur, n)
        chain = itertools.chain.from_iterable
        i, total = 0, len(rows)
        while i < total:
            while total - i < size:
                size //= 2
            sql = self._insert_sql.get((prefix, size))
            if sql is None:
                sql = self._insert_sql[(prefix, size)] = prefix + ", ".join([group] * size)
            cur.execute(sql, list(chain(rows[i : i + size])))
            i += size

    def _rows_per_insert(self, cur: Any, columns: int) -> int:
        limit = self._variable_limit
        if limit is None:
            limit = self._variable_limit = cur.connection.getlimit(
                sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER
            )
        size = 1
        while size * 2 <= ROWS_PER_INSERT and size * 2 * columns <= limit:
            size *= 2
        return size

    def _close_raw(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()
            self.checkpointer = None
        if self._raw is not None:
            self._raw.close()
            self._raw = None

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._thread, self._close_raw)
        self._thread.shutdown(wait=True)
        await super().close()


#: the fewest rows PostgreSQL inserts with COPY rather than executemany
PG_COPY_MIN_ROWS = 32


class _PgCursor:
    """The DBAPI cursor of a write transaction, and the asyncpg connection under it
    (for ``COPY``, which the DBAPI layer does not offer)."""

    def __init__(self, cursor: Any, driver: Any) -> None:
        self._cursor = cursor
        self.driver = driver

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cursor, name)


class PostgresDialect(Dialect):
    """PostgreSQL: several server processes (replicas) share the database."""

    shared = True

    def __init__(self, engine: AsyncEngine) -> None:
        super().__init__(engine)
        self._listen_conn: AsyncConnection | None = None
        #: the connection holding this process's session writer locks
        self._lock_conn: AsyncConnection | None = None
        self._lock_mutex = asyncio.Lock()
        #: the writer's connection for :meth:`append_batch`
        self._append_conn: AsyncConnection | None = None

    def sql(self, text: str) -> str:
        parts = text.split("?")
        return "".join(p + (f"${i}" if i < len(parts) else "") for i, p in enumerate(parts, 1))

    async def transaction(self, work: Work[R], before_commit: Hook[R], *, small: bool = False) -> R:
        def run(conn: sa.Connection) -> R:
            tx = conn.begin()
            try:
                adapted: Any = conn.connection.dbapi_connection
                result = work(_PgCursor(adapted.cursor(), adapted.driver_connection))
                if before_commit is not None:
                    await_only(before_commit(result))
                tx.commit()
            except BaseException:
                tx.rollback()
                raise
            return result

        async with self.engine.connect() as conn:
            return await conn.run_sync(run)

    def insert_rows(
        self, cur: Any, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]
    ) -> None:
        """One binary ``COPY`` of the rows, in the transaction: 1.4-1.8x the rate of
        asyncpg's ``executemany`` of the same rows on the test server.

        asyncpg's own errors are raised as SQLAlchemy's, so the writer maps them
        as it maps every other statement's: a uniqueness violation is a
        conflict, a lost connection or a shutting-down server is unavailable,
        anything else the server refuses is the request's fault.
        """
        import asyncpg

        driver = getattr(cur, "driver", None)
        if driver is None or len(rows) < PG_COPY_MIN_ROWS:
            # a few rows: COPY's extra round trip costs more than it saves
            super().insert_rows(cur, table, columns, rows)
            return
        statement = f"COPY {table} ({', '.join(columns)}) FROM STDIN (FORMAT binary)"
        try:
            await_only(driver.copy_records_to_table(table, records=rows, columns=list(columns)))
        except asyncpg.exceptions.PostgresError as exc:
            raise _as_sqlalchemy(statement, exc) from exc
        except (asyncpg.exceptions.InterfaceError, asyncpg.exceptions.InternalClientError) as exc:
            raise _as_sqlalchemy(statement, exc) from exc

    async def append_batch(self, args: Sequence[Any]) -> bool | None:
        """One ``sessiontape_append`` call (migrations/versions/0002_pg_append.py) on the
        writer's own connection: the whole batch in one round trip and one transaction.
        True when it committed; False when the log moved on since the plan (nothing
        written). Errors are raised as SQLAlchemy's, as the usual path raises them."""
        import asyncpg

        statement = (
            "SELECT sessiontape_append($1"
            + "".join(f", ${i}" for i in range(2, len(args) + 1))
            + ")"
        )
        try:
            if self._append_conn is None:
                conn = await self.engine.connect()
                self._append_conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
            raw = await self._append_conn.get_raw_connection()
            driver: Any = raw.driver_connection
            return bool(await driver.fetchval(statement, *args))
        except (
            asyncpg.exceptions.PostgresError,
            asyncpg.exceptions.InterfaceError,
            asyncpg.exceptions.InternalClientError,
            OSError,
        ) as exc:
            mapped = _as_sqlalchemy(statement, exc)
            if isinstance(mapped, OperationalError):
                await self._drop_append_conn()
            raise mapped from exc

    async def _drop_append_conn(self) -> None:
        conn, self._append_conn = self._append_conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.invalidate()
            with contextlib.suppress(Exception):
                await conn.close()

    def lock_positions(self, cur: Any) -> None:
        cur.execute(self.sql("SELECT pg_advisory_xact_lock(?)"), (PG_LOCK_KEY,))

    def notify(self, cur: Any, position: int) -> None:
        cur.execute(self.sql("SELECT pg_notify(?, ?)"), (PG_CHANNEL, str(position)))

    async def migration_lock(self, conn: AsyncConnection) -> None:
        await conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": PG_MIGRATE_KEY})

    async def listen(self, wake: Callable[[int | None], None]) -> None:
        self._listen_conn = await self.engine.connect()
        raw = await self._listen_conn.get_raw_connection()

        def notified(_conn: Any, _pid: int, _channel: str, payload: str) -> None:
            wake(int(payload) if payload.isdigit() else None)

        await raw.driver_connection.add_listener(PG_CHANNEL, notified)  # type: ignore[union-attr]

    async def try_lock_session(self, session_id: str) -> bool:
        """A session-level advisory lock on one connection kept for all of this
        process's locks, so a process that dies releases them with its connection."""
        async with self._lock_mutex:
            if self._lock_conn is None:
                conn = await self.engine.connect()
                self._lock_conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
            got = (
                await self._lock_conn.execute(
                    sa.text("SELECT pg_try_advisory_lock(:k)"), {"k": session_lock_key(session_id)}
                )
            ).scalar()
        return bool(got)

    async def unlock_session(self, session_id: str) -> None:
        async with self._lock_mutex:
            conn = self._lock_conn
            if conn is None:
                return  # the connection went away, and its locks with it
            try:
                await conn.execute(
                    sa.text("SELECT pg_advisory_unlock(:k)"), {"k": session_lock_key(session_id)}
                )
            except Exception:
                log.warning(
                    "releasing the writer lock of %s failed; dropping the lock connection",
                    session_id,
                )
                self._lock_conn = None
                with contextlib.suppress(Exception):
                    await conn.close()

    async def close(self) -> None:
        await self._drop_append_conn()
        for conn in (self._listen_conn, self._lock_conn):
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()
        self._listen_conn = self._lock_conn = None
        await super().close()


def _as_sqlalchemy(statement: str, exc: BaseException) -> DBAPIError:
    """An asyncpg error raised as SQLAlchemy raises it, so the writer maps every
    statement's errors one way: a uniqueness violation is a conflict, a lost
    connection or a shutting-down server is unavailable, anything else the server
    refuses is the request's fault."""
    import asyncpg

    if isinstance(exc, asyncpg.exceptions.IntegrityConstraintViolationError):
        return IntegrityError(statement, None, exc)
    if isinstance(
        exc,
        asyncpg.exceptions.PostgresConnectionError
        | asyncpg.exceptions.OperatorInterventionError
        | asyncpg.exceptions.InterfaceError
        # how asyncpg reports a connection the server ended mid-protocol
        | asyncpg.exceptions.InternalClientError
        | OSError,
    ):
        return OperationalError(statement, None, exc, connection_invalidated=True)
    return DBAPIError(statement, None, exc)
