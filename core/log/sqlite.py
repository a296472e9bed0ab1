"""SQLite, the embedded default: one process writes, in its own thread or inline."""

from __future__ import annotations

import asyncio
import itertools
import logging
import sqlite3
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sqlalchemy import event as sa_event
from sqlalchemy.ext.asyncio import create_async_engine

from sessiontape.core.log.checkpoint import BACKSTOP_PAGES, Checkpointer
from sessiontape.core.log.dialect import Dialect, Hook, NotNow, R, Work

log = logging.getLogger("sessiontape.log")


#: the most rows one multi-row INSERT carries on SQLite (a power of two)
ROWS_PER_INSERT = 1024

#: threads (each with its own connection) that read a file database for the log
READERS = 2


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
        #: reads of a file database: plain sqlite3 connections, one per reader thread
        self._readers = ThreadPoolExecutor(
            max_workers=READERS, thread_name_prefix="sessiontape-log-reader"
        )
        self._reader_local = threading.local()
        self._reader_conns: list[sqlite3.Connection] = []
        self._reader_lock = threading.Lock()
        self._reader_generation = 0

    def _pragmas(self, dbapi_conn: Any, _rec: Any = None) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA synchronous={self.synchronous}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    def sql(self, text: str) -> str:
        return text

    async def fetch(self, sql: str, params: Sequence[Any]) -> list[Sequence[Any]]:
        """On a reader thread's own sqlite3 connection, not as SQLAlchemy rows built one by
        one on the event loop (aiosqlite), which takes three times as long for a long
        session. An in-memory database has no second connection to it."""
        if self.path in ("", ":memory:"):
            return await super().fetch(sql, params)
        return await asyncio.get_running_loop().run_in_executor(
            self._readers, self._fetch, sql, tuple(params)
        )

    def _fetch(self, sql: str, params: tuple[Any, ...]) -> list[Sequence[Any]]:
        local = self._reader_local
        conn: sqlite3.Connection | None = getattr(local, "conn", None)
        if conn is not None and local.generation != self._reader_generation:
            self._drop_reader(conn)  # the pool was reset since (reset_pool): open anew
            conn = None
        if conn is None:
            conn = sqlite3.connect(
                self.path, timeout=30, isolation_level=None, check_same_thread=False
            )
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

    async def reset_pool(self) -> None:
        # each reader thread closes its own connection at its next read
        self._reader_generation += 1
        # a file's connections are not dead sockets: closed, not just dropped
        await self.engine.dispose()

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._thread, self._close_raw)
        self._thread.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        self._close_readers()
        await super().close()
