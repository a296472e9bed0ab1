"""PostgreSQL: several server processes (replicas) share the database.

Reached one way: SQLAlchemy's asyncpg engine, whose pool hands out every
connection (reads, write transactions, the writer's one-call appends, the
session locks, LISTEN, Alembic's migrations); the hot paths talk to the
asyncpg connection under a pooled one, with asyncpg's errors raised as
SQLAlchemy's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine
from sqlalchemy.util import await_only

from sessiontape.core.log.dialect import Dialect, Hook, Migration, R, Work, session_lock_key

log = logging.getLogger("sessiontape.log")


PG_LOCK_KEY = 0x5E55_1074  # transaction-scoped advisory lock around position assignment
PG_CHANNEL = "sessiontape_events"
PG_MIGRATE_KEY = 0x5E55_1075


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
    one_call_append = True

    def __init__(self, url: str, *, echo: bool = False) -> None:
        super().__init__(url)
        self.engine = create_async_engine(url, echo=echo)
        dbapi = self.engine.dialect.dbapi
        # InternalError too: asyncpg reports a connection the server terminated
        # mid-protocol as an InternalClientError ("another operation is in progress")
        self.driver_conflicts = _classes(dbapi, "IntegrityError")
        self.driver_unavailable = _classes(
            dbapi, "OperationalError", "InterfaceError", "InternalError"
        )
        self._listen_conn: AsyncConnection | None = None
        #: the connection holding this process's session writer locks
        self._lock_conn: AsyncConnection | None = None
        #: its asyncpg connection, and the ``_lock_conn`` it belongs to
        self._lock_driver: tuple[AsyncConnection, Any] | None = None
        self._lock_mutex = asyncio.Lock()
        #: the writer's connection for :meth:`append_batch`
        self._append_conn: AsyncConnection | None = None

    def sql(self, text: str) -> str:
        parts = text.split("?")
        return "".join(p + (f"${i}" if i < len(parts) else "") for i, p in enumerate(parts, 1))

    async def fetch(self, sql: str, params: Sequence[Any]) -> list[Sequence[Any]]:
        """On a pooled connection's asyncpg connection: its records, not SQLAlchemy rows
        built one by one on the event loop (a fifth less time for a long session)."""
        statement = self.sql(sql)
        async with self.engine.connect() as conn, _driver_call(statement, conn.invalidate):
            raw = await conn.get_raw_connection()
            return list(await raw.driver_connection.fetch(statement, *params))  # type: ignore[union-attr]

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
        """One binary ``COPY`` of the rows, in the transaction: faster than
        asyncpg's ``executemany`` of the same rows (one round trip, binary rows).

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

    async def append_batch(self, args: Sequence[Any]) -> bool:
        """One ``sessiontape_append`` call (migrations/versions/0002_pg_append.py; events
        with data since 0003_pg_append_data.py) on the writer's own connection: the
        whole batch in one round trip and one transaction. True when it committed;
        False when the log moved on since the plan (nothing written). Errors are
        raised as SQLAlchemy's, as the usual path raises them."""
        statement = (
            "SELECT sessiontape_append($1"
            + "".join(f", ${i}" for i in range(2, len(args) + 1))
            + ")"
        )
        async with _driver_call(statement, self._drop_append_conn):
            if self._append_conn is None:
                conn = await self.engine.connect()
                self._append_conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
            raw = await self._append_conn.get_raw_connection()
            driver: Any = raw.driver_connection
            return bool(await driver.fetchval(statement, *args))

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

    async def alembic(self, work: Migration[R]) -> R:
        async with self.engine.begin() as conn:
            # several servers starting on a fresh database migrate one at a time
            await conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": PG_MIGRATE_KEY})
            return await conn.run_sync(work)

    async def reset_pool(self) -> None:
        await self.engine.dispose(close=False)

    async def listen(self, wake: Callable[[int | None], None]) -> None:
        self._listen_conn = await self.engine.connect()
        raw = await self._listen_conn.get_raw_connection()

        def notified(_conn: Any, _pid: int, _channel: str, payload: str) -> None:
            wake(int(payload) if payload.isdigit() else None)

        await raw.driver_connection.add_listener(PG_CHANNEL, notified)  # type: ignore[union-attr]

    async def try_lock_session(self, session_id: str) -> bool:
        """A session-level advisory lock on one connection kept for all of this
        process's locks, so a process that dies releases them with its connection.

        Taken and released with the driver's own calls: through SQLAlchemy's text
        statements a lock and its release cost three times this process's CPU
        (once per generation, one after another on this one connection)."""
        async with self._lock_mutex:
            got = await self._on_lock_conn("SELECT pg_try_advisory_lock($1)", session_id)
        return bool(got)

    async def unlock_session(self, session_id: str) -> None:
        async with self._lock_mutex:
            if self._lock_conn is None:
                return  # the connection went away, and its locks with it
            try:
                await self._on_lock_conn("SELECT pg_advisory_unlock($1)", session_id)
            except Exception:
                log.warning(
                    "releasing the writer lock of %s failed; dropping the lock connection",
                    session_id,
                )
                await self._drop_lock_conn()

    async def _on_lock_conn(self, statement: str, session_id: str) -> Any:
        """``statement`` with the session's lock key, on the lock connection (opened
        on first use); asyncpg's errors raised as SQLAlchemy's, and a lost connection
        dropped (the server released its locks with it)."""
        async with _driver_call(statement, self._drop_lock_conn):
            if self._lock_conn is None:
                conn = await self.engine.connect()
                self._lock_conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
            if self._lock_driver is None or self._lock_driver[0] is not self._lock_conn:
                raw = await self._lock_conn.get_raw_connection()
                self._lock_driver = (self._lock_conn, raw.driver_connection)
            return await self._lock_driver[1].fetchval(statement, session_lock_key(session_id))

    async def _drop_lock_conn(self) -> None:
        conn, self._lock_conn, self._lock_driver = self._lock_conn, None, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.invalidate()
            with contextlib.suppress(Exception):
                await conn.close()

    async def close(self) -> None:
        await self._drop_append_conn()
        for conn in (self._listen_conn, self._lock_conn):
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()
        self._listen_conn = self._lock_conn = None
        self._lock_driver = None
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


def _classes(module: Any, *names: str) -> tuple[type[BaseException], ...]:
    """The exception classes ``module`` (a DBAPI module) has of ``names``."""
    found = (getattr(module, name, None) for name in names)
    return tuple(k for k in found if isinstance(k, type) and issubclass(k, BaseException))


def _driver_errors() -> tuple[type[BaseException], ...]:
    """What a call on asyncpg's own connection raises for a database error, a lost
    connection or a broken protocol: what :func:`_as_sqlalchemy` maps."""
    import asyncpg

    return (
        asyncpg.exceptions.PostgresError,
        asyncpg.exceptions.InterfaceError,
        asyncpg.exceptions.InternalClientError,
        OSError,
    )


@contextlib.asynccontextmanager
async def _driver_call(statement: str, drop: Callable[[], Awaitable[None]]) -> AsyncIterator[None]:
    """Around a call on asyncpg's own connection: its errors raised as SQLAlchemy's
    (:func:`_as_sqlalchemy`), and a lost connection given to ``drop`` first, so it is
    not used again."""
    try:
        yield
    except _driver_errors() as exc:
        mapped = _as_sqlalchemy(statement, exc)
        if isinstance(mapped, OperationalError):
            await drop()
        raise mapped from exc


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
