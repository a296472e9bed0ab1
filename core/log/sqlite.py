"""SQLite, the embedded default: one process writes, in its own thread or inline.

Reached one way, through the standard library's ``sqlite3``: the writer
thread's connection takes every write (the log's transactions, snapshots) and
runs Alembic's migrations under a short-lived SQLAlchemy engine built on it;
each reader thread reads on a connection of its own. An in-memory database
exists only on the writer's connection, so it is read there too, on the
writer thread.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import sqlite3
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.pool import StaticPool

from sessiontape.core.log.checkpoint import BACKSTOP_PAGES, Checkpointer
from sessiontape.core.log.dialect import Dialect, Hook, Migration, NotNow, R, Work

log = logging.getLogger("sessiontape.log")
#: each statement, when the log was opened with ``echo``
sql_log = logging.getLogger("sessiontape.log.sql")


#: the most rows one multi-row INSERT carries on SQLite (a power of two)
ROWS_PER_INSERT = 1024

#: threads (each with its own connection) that read a file database for the log
READERS = 2

#: how long a statement waits for another connection's lock before it fails
BUSY_TIMEOUT_S = 30


class SQLiteDialect(Dialect):
    """SQLite in WAL mode: one server process writes; others (the CLI) read."""

    driver_conflicts = (sqlite3.IntegrityError,)
    driver_unavailable = (sqlite3.OperationalError,)

    def __init__(self, url: str, *, echo: bool, synchronous: str) -> None:
        super().__init__(url)
        self.synchronous = synchronous
        self.echo = echo
        self.path = make_url(url).database or ":memory:"
        self.in_memory = self.path == ":memory:"
        #: the writer's own connection, used only from the writer thread, or
        #: inline on the loop's thread while nothing is queued for that thread
        self._raw: sqlite3.Connection | None = None
        #: whether ``_raw``'s busy timeout is 0 now (an inline try) rather than 30 s
        self._nowait = False
        self._thread = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="sessiontape-log-writer"
        )
        #: calls handed to the writer thread (counted on the loop's thread) and
        #: finished there (counted on the writer thread): equal when it is idle
        self._handed = 0
        self._done = 0
        #: multi-row INSERT texts by (prefix, rows); SQLite's bound-variable limit
        self._insert_sql: dict[tuple[str, int], str] = {}
        self._variable_limit: int | None = None
        #: checkpoints on a thread of their own (a file database; started with the writer)
        self.checkpointer: Checkpointer | None = None
        #: reads of a file database: plain sqlite3 connections, one per reader thread
        self._readers = ThreadPoolExecutor(
            max_workers=READERS, thread_name_prefix="sessiontape-log-reader"
        )
        self._reader_local = threading.local()
        self._reader_conns: list[sqlite3.Connection] = []
        self._reader_lock = threading.Lock()
        self._reader_generation = 0

    def _connect(self) -> sqlite3.Connection:
        """A connection of this dialect's (autocommit: transactions are begun explicitly)."""
        conn = sqlite3.connect(
            self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
        )
        if self.echo:
            conn.set_trace_callback(sql_log.info)
        return conn

    def _pragmas(self, conn: sqlite3.Connection) -> None:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={self.synchronous}")
        conn.execute("PRAGMA foreign_keys=ON")

    def _writer_connection(self) -> sqlite3.Connection:
        """The writer's connection, opened on first use (on the writer thread)."""
        raw = self._raw
        if raw is None:
            raw = self._raw = self._connect()
            self._pragmas(raw)
            self._nowait = False  # connect's timeout: 30 s
            if not self.in_memory:
                # checkpoints run on the checkpoint thread, not inside this
                # connection's commits; its own automatic one is only a backstop
                raw.execute(f"PRAGMA wal_autocheckpoint={BACKSTOP_PAGES}")
        return raw

    def _on_writer(self, fn: Callable[..., R], *args: Any) -> asyncio.Future[R]:
        """``fn(*args)`` on the writer thread, counted (:meth:`_writer_idle`)."""
        self._handed += 1
        try:
            return asyncio.get_running_loop().run_in_executor(
                self._thread, self._counted, fn, *args
            )
        except BaseException:
            self._handed -= 1
            raise

    def _counted(self, fn: Callable[..., R], *args: Any) -> R:
        try:
            return fn(*args)
        finally:
            self._done += 1

    def _writer_idle(self) -> bool:
        """Whether the writer's connection may be used right here, on the loop's thread:
        it is open, and nothing handed to the writer thread is queued or running."""
        return self._raw is not None and self._handed == self._done

    async def alembic(self, work: Migration[R]) -> R:
        """On the writer's connection, on its thread: SQLAlchemy's engine is built on it
        for the run and disposed after, leaving the connection open. The statements
        run as SQLite's Python driver runs them by default (DDL on its own, a
        transaction opened before a data change and committed at the end), as
        the migrations expect (migrations/versions/0004_sqlite_position_rowid.py)."""
        return await self._on_writer(self._alembic, work)

    def _alembic(self, work: Migration[R]) -> R:
        raw = self._writer_connection()
        engine = sa.create_engine("sqlite://", creator=lambda: raw, poolclass=StaticPool)
        raw.isolation_level = "DEFERRED"
        try:
            with engine.begin() as conn:
                return work(conn)
        finally:
            if raw.in_transaction:
                raw.rollback()
            raw.isolation_level = None
            engine.dispose(close=False)  # the connection is the writer's: kept open

    def sql(self, text: str) -> str:
        return text

    async def fetch(self, sql: str, params: Sequence[Any]) -> list[Sequence[Any]]:
        """On a reader thread's own sqlite3 connection (a read waits for no write, and
        its rows are built off the event loop). An in-memory database has no second
        connection to it: it is read on the writer's, on the writer thread."""
        if self.in_memory:
            return await self._on_writer(self._fetch_on_writer, sql, tuple(params))
        return await asyncio.get_running_loop().run_in_executor(
            self._readers, self._fetch, sql, tuple(params)
        )

    def _fetch_on_writer(self, sql: str, params: tuple[Any, ...]) -> list[Sequence[Any]]:
        return self._writer_connection().execute(sql, params).fetchall()

    def _fetch(self, sql: str, params: tuple[Any, ...]) -> list[Sequence[Any]]:
        local = self._reader_local
        conn: sqlite3.Connection | None = getattr(local, "conn", None)
        if conn is not None and local.generation != self._reader_generation:
            self._drop_reader(conn)  # the pool was reset since (reset_pool): open anew
            conn = None
        if conn is None:
            conn = self._connect()
            conn.execute("PRAGMA query_only=ON")
            with self._reader_lock:
                self._reader_conns.append(conn)
            local.conn, local.generation = conn, self._reader_generation
        try:
            return conn.execute(sql, params).fetchall()
        except sqlite3.Error:
            # a connection that failed once is not trusted again: the next read opens anew
            local.conn = None
            self._drop_reader(conn)
            raise

    def _drop_reader(self, conn: sqlite3.Connection) -> None:
        with self._reader_lock:
            if conn in self._reader_conns:
                self._reader_conns.remove(conn)
        conn.close()

    def _close_readers(self) -> None:
        with self._reader_lock:
            conns, self._reader_conns = self._reader_conns, []
        for conn in conns:
            conn.close()

    async def transaction(self, work: Work[R], before_commit: Hook[R], *, small: bool = False) -> R:
        loop = asyncio.get_running_loop()
        if small and before_commit is None and self._writer_idle():
            # One request alone: a WAL commit without fsync takes less than handing
            # it to the writer thread and back (two GIL hand-offs and several loop
            # turns), so try it right here when the writer thread has nothing of
            # this connection's (a snapshot, a read of an in-memory database), unless
            # another connection holds the write lock, which the writer thread then
            # waits for instead (the loop never waits on it). Larger batches go to
            # the thread, where SQLite's work overlaps the loop's.
            try:
                return self._transaction(loop, work, None, wait=False)
            except NotNow:
                pass
        return await self._on_writer(self._transaction, loop, work, before_commit)

    def transaction_now(self, work: Work[R]) -> R:
        if not self._writer_idle():
            raise NotNow
        return self._transaction(asyncio.get_running_loop(), work, None, wait=False)

    def _transaction(
        self,
        loop: asyncio.AbstractEventLoop,
        work: Work[R],
        before_commit: Hook[R],
        wait: bool = True,
    ) -> R:
        raw = self._writer_connection()
        if self.checkpointer is None and not self.in_memory:
            self.checkpointer = Checkpointer(self.path, self.synchronous)
        # IMMEDIATE takes the write lock now: positions are read and assigned under it.
        # An inline try must not wait for another connection's lock (the loop would
        # block on it): its busy timeout is 0, set only when the mode changes, since
        # consecutive inline commits (one generation's runs) would pay two statements each.
        if self._nowait != (not wait):
            raw.execute(f"PRAGMA busy_timeout = {0 if not wait else BUSY_TIMEOUT_S * 1000}")
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

    async def reset_pool(self) -> None:
        # each reader thread closes its own connection at its next read
        self._reader_generation += 1

    async def close(self) -> None:
        await self._on_writer(self._close_raw)
        self._thread.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        self._close_readers()
