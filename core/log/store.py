"""The event log: appends through one writer with group commit, reads, subscriptions.

Usage::

    log = await EventLog.open("sqlite+aiosqlite:///./sessiontape.db")
    [e] = await log.append("s1", 0, [NewEvent(T.SESSION_OPENED, {...})])
    async for e in log.subscribe(from_position=0):
        ...
    await log.close()

Where the parts live: the group-commit writer in ``core/log/writer.py``,
subscriptions and the tailer in ``core/log/subscriptions.py``, everything
that differs between SQLite and PostgreSQL in ``core/log/dialect.py``, the
tables in ``core/log/schema.py``. Only committed events are handed to
subscribers or returned to callers ("durable before visible"). Positions are
assigned by the writer inside the write transaction, under SQLite's write
lock or a transaction-scoped advisory lock on PostgreSQL, so they are
gapless and become visible in order (docs/architecture.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, Concatenate, ParamSpec, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import make_url

from sessiontape.core.bodies import SessionPurged
from sessiontape.core.bodies import body as typed_body
from sessiontape.core.errors import (
    ChainBroken,
    InvalidArgument,
    InvalidEvent,
    SessionNotFound,
    SessiontapeError,
)
from sessiontape.core.events import GENESIS_HASH, Event, NewEvent, T, event_hash, parse_json
from sessiontape.core.handback import handing_back
from sessiontape.core.log.dialect import Dialect, session_lock_key
from sessiontape.core.log.plan import Request, RequestKind
from sessiontape.core.log.postgres import PostgresDialect
from sessiontape.core.log.sqlite import SQLiteDialect
from sessiontape.core.log.subscriptions import Subscriptions
from sessiontape.core.log.writer import Writer, unavailable

__all__ = ["EventLog", "SessionRow", "session_lock_key", "verify_chain"]


@dataclass
class SessionRow:
    """One row of the sessions index (what ``sessions ls`` needs)."""

    id: str
    protocol: str
    status: str
    label: str
    engine: str
    model_id: str
    parent_id: str | None
    parent_version: int | None
    fork_position: int | None
    created_at: float
    updated_at: float
    last_active_at: float
    ttl_s: float | None
    version: int
    head_hash: str
    event_count: int
    history_length: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


P = ParamSpec("P")
R = TypeVar("R")

#: the sessions index's columns in SessionRow's order, for the driver's own reads
_SESSION_COLUMNS = ", ".join(f.name for f in fields(SessionRow))

#: blob hashes looked up in one statement (inside SQLite's bound-variable limit)
_BLOBS_PER_READ = 500


def _reading(
    fn: Callable[Concatenate[EventLog, P], Awaitable[R]],
) -> Callable[Concatenate[EventLog, P], Awaitable[R]]:
    """A read of the log (or a snapshot's write), as callers see it.

    A database that went away raises LogUnavailable, not the driver's error.
    A caller cancelled mid-read (a stream cut at shutdown) lets the query
    finish first: a connection cancelled mid-query is invalidated, and the
    driver adapters' graceful close of it can be left pending forever
    ("Task was destroyed but it is pending").
    """

    async def run(self: EventLog, *args: Any, **kwargs: Any) -> R:
        try:
            return await fn(self, *args, **kwargs)
        except SessiontapeError:
            raise
        except Exception as exc:
            if self.dialect.is_unavailable(exc):
                await self.dialect.reset_pool()
                raise unavailable(exc) from exc
            raise

    @functools.wraps(fn)
    async def read(self: EventLog, /, *args: P.args, **kwargs: P.kwargs) -> R:
        task = asyncio.ensure_future(run(self, *args, **kwargs))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            while not task.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(task)
            raise

    return read


def open_dialect(url: str, *, echo: bool = False, sqlite_synchronous: str = "NORMAL") -> Dialect:
    """The dialect of ``url``: core/log/sqlite.py or core/log/postgres.py (which
    connects how: docs/architecture.md, "Database access")."""
    backend = make_url(url).get_backend_name()
    if backend == "sqlite":
        return SQLiteDialect(url, echo=echo, synchronous=sqlite_synchronous)
    if backend == "postgresql":
        return PostgresDialect(url, echo=echo)
    raise ValueError(f"unsupported database {backend!r} (SQLite or PostgreSQL)")


class EventLog:
    """The log. Create with :meth:`open`; one instance per process and database."""

    def __init__(
        self,
        dialect: Dialect,
        *,
        batch_max: int = 2000,
        inline_max_bytes: int = 4096,
        poll_interval_s: float = 0.5,
        follow: bool = False,
    ) -> None:
        self.dialect = dialect
        self.subscriptions = Subscriptions(
            self._read_page, tail=dialect.shared or follow, poll_interval_s=poll_interval_s
        )
        self.writer = Writer(
            dialect,
            self.subscriptions.committed,
            batch_max=batch_max,
            inline_max_bytes=inline_max_bytes,
            on_expect=self.subscriptions.expect,
        )

    @property
    def before_commit(self) -> Callable[[list[Event]], Awaitable[None]] | None:
        """Test hook: awaited inside the write transaction, just before COMMIT."""
        return self.writer.before_commit

    @before_commit.setter
    def before_commit(self, hook: Callable[[list[Event]], Awaitable[None]] | None) -> None:
        self.writer.before_commit = hook

    @property
    def inline_max_bytes(self) -> int:
        """Payloads larger than this go to content-addressed blobs."""
        return self.writer.inline_max_bytes

    @property
    def url(self) -> str:
        """The database's URL, as the log was opened with it."""
        return self.dialect.url

    @property
    def shared(self) -> bool:
        """Whether other server processes may write to this database (PostgreSQL replicas)."""
        return self.dialect.shared

    def known_end(self) -> int:
        """A lower bound of :meth:`last_position`, from memory (the log's end when this
        process opened it, and what it committed or read from other processes since):
        reading nothing, it can say a position exists, never that one does not."""
        return max(self.subscriptions.published, self.writer.last_position or 0)

    # -- lifecycle ---------------------------------------------------------

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        migrate: bool = True,
        echo: bool = False,
        batch_max: int = 2000,
        inline_max_bytes: int = 4096,
        poll_interval_s: float = 0.5,
        sqlite_synchronous: str = "NORMAL",
        follow: bool = False,
    ) -> EventLog:
        """Connect, migrate a fresh database to head, and start the writer.

        ``follow`` makes subscriptions see other processes' commits on SQLite
        too (by polling); PostgreSQL always does (LISTEN/NOTIFY plus polling).
        ``echo`` logs every statement.
        """
        dialect = open_dialect(url, echo=echo, sqlite_synchronous=sqlite_synchronous)
        self = cls(
            dialect,
            batch_max=batch_max,
            inline_max_bytes=inline_max_bytes,
            poll_interval_s=poll_interval_s,
            follow=follow,
        )
        if migrate:
            from sessiontape.migrations.runner import upgrade_connection

            await dialect.alembic(upgrade_connection)
        # where the log ends: read once, then known from this process's commits (and, when
        # other processes write, from tailing theirs)
        self.subscriptions.start(await self.last_position())
        await dialect.listen(self.subscriptions.wake)
        self.writer.start()
        return self

    async def revision(self) -> str | None:
        """The schema's migration revision (Alembic's), None before the first."""
        from sessiontape.migrations.runner import current_revision

        return await self.dialect.alembic(current_revision)

    async def close(self) -> None:
        """Commit what is queued, refuse what comes after, stop."""
        await self.writer.close()
        await self.subscriptions.close()
        await self.dialect.close()

    # -- writing -----------------------------------------------------------

    async def append(
        self,
        session_id: str,
        expected_version: int,
        new_events: Sequence[NewEvent],
        *,
        index: Mapping[str, Any] | None = None,
    ) -> list[Event]:
        """Append ``new_events`` after ``expected_version``; returns them committed.

        Raises :class:`ConcurrencyError` (nothing written) when the session's
        current version is not ``expected_version``. ``index`` carries
        sessions-table columns the caller knows (``history_length``).
        """
        req = self._append_request(session_id, expected_version, new_events, index)
        if req is None:
            return []
        return await self.writer.submit(req)

    def append_now(
        self,
        session_id: str,
        expected_version: int,
        new_events: Sequence[NewEvent],
        *,
        index: Mapping[str, Any] | None = None,
    ) -> list[Event] | None:
        """:meth:`append`, committed right away without awaiting anything when the
        writer is idle (:meth:`Writer.commit_now`); None when it was not (nothing
        written: :meth:`append` it then, which queues it for the write loop and
        its group commit). A caller that must not be cancelled half-way through
        a commit can take this path without guarding it."""
        req = self._append_request(session_id, expected_version, new_events, index)
        if req is None:
            return []
        return self.writer.commit_now(req)

    def _append_request(
        self,
        session_id: str,
        expected_version: int,
        new_events: Sequence[NewEvent],
        index: Mapping[str, Any] | None,
    ) -> Request | None:
        if isinstance(new_events, NewEvent) or not all(isinstance(e, NewEvent) for e in new_events):
            raise InvalidArgument("append takes a sequence of NewEvent")
        if not new_events:
            return None
        return Request(RequestKind.APPEND, session_id, expected_version, list(new_events), index)

    async def touch(self, session_id: str, at: float | None = None) -> None:
        """Refresh a session's idle clock without an event."""
        await self.writer.submit(
            Request(RequestKind.TOUCH, session_id, -1, (), None, at or time.time())
        )

    async def import_events(
        self, evs: Sequence[Event], *, index: Mapping[str, Any] | None = None
    ) -> list[Event]:
        """Insert exported events verbatim (new positions, same chain).

        Raises ChainBroken (nothing written) when the events do not chain,
        InvalidEvent when they do not start a session (a purged session's
        export holds only its tombstone: it verifies, but there is nothing left
        to import), and ConcurrencyError when the session already has events.
        """
        if not evs:
            return []
        sid = evs[0].session_id
        if any(e.session_id != sid for e in evs):
            raise InvalidEvent("an import batch must hold one session")
        verify_chain(evs)
        if evs[0].type != T.SESSION_OPENED or evs[0].version != 1:
            what = (
                "was purged (its export is only the tombstone)"
                if evs[0].type == T.SESSION_PURGED
                else (f"starts at version {evs[0].version} with {evs[0].type}")
            )
            raise InvalidEvent(
                f"session {sid} {what}: an import must start with session.opened at version 1"
            )
        return await self.writer.submit(
            Request(RequestKind.IMPORT, sid, evs[0].version - 1, list(evs), index)
        )

    async def purge(self, session_id: str, reason: str = "retention") -> Event:
        """Delete a session's events, leaving a ``session.purged`` tombstone."""
        row = await self.get_session(session_id)
        req = Request(
            RequestKind.PURGE,
            session_id,
            row.version,
            [NewEvent(T.SESSION_PURGED, {"reason": reason})],
        )
        return (await self.writer.submit(req))[0]

    # -- one writer per session across processes -----------------------------

    async def try_lock_session(self, session_id: str) -> bool:
        """Take the cross-process writer lock of a session (a generation holds it).

        False when another process holds it (PostgreSQL: a session-level
        advisory lock, released with the holder's connection if it dies).
        SQLite has one writing process: always True. Raises LogUnavailable when the
        database cannot be asked (the next call opens a new lock connection). A
        caller cancelled meanwhile lets the call finish and releases a lock it got,
        so no lock outlives the cancel.
        """
        if not self.dialect.shared:
            return True  # no other process to hold it off: no task to shield
        task = asyncio.ensure_future(self.dialect.try_lock_session(session_id))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                if await task:
                    await self.dialect.unlock_session(session_id)
            raise
        except Exception as exc:
            if isinstance(exc, sa.exc.DBAPIError | sa.exc.TimeoutError) or (
                self.dialect.is_unavailable(exc)
            ):
                raise unavailable(exc) from exc
            raise

    async def unlock_session(self, session_id: str) -> None:
        await self.dialect.unlock_session(session_id)

    # -- reading -----------------------------------------------------------

    _COLUMNS = (
        "position, session_id, version, type, body, data, blob_sha, recorded_at, hash, prev_hash"
    )

    async def _fetch_events(self, sql: str, params: tuple[Any, ...]) -> list[Event]:
        rows = await self.dialect.fetch(sql, params)
        shas = sorted({r[6] for r in rows if r[6] is not None})
        blob_data: dict[str, bytes] = {}
        for i in range(0, len(shas), _BLOBS_PER_READ):
            some = shas[i : i + _BLOBS_PER_READ]
            marks = ", ".join("?" * len(some))
            for sha, data in await self.dialect.fetch(
                f"SELECT sha256, data FROM blobs WHERE sha256 IN ({marks})", some
            ):
                blob_data[sha] = bytes(data)
        loads = parse_json
        out = []
        async for row in handing_back(rows):  # a long history does not stall other sessions
            pos, sid, version, type_, body, data, blob_sha, recorded_at, h, prev = row
            if blob_sha is not None:
                data = blob_data[blob_sha]
            elif data is not None:
                data = bytes(data)
            out.append(Event(pos, sid, version, type_, loads(body), data, recorded_at, h, prev))
        return out

    @_reading
    async def read(
        self, session_id: str, from_version: int = 1, to_version: int | None = None
    ) -> list[Event]:
        """A session's events in version order, ``from_version`` to ``to_version`` inclusive."""
        top = 2**31 - 1 if to_version is None else to_version
        return await self._fetch_events(
            f"SELECT {self._COLUMNS} FROM events WHERE session_id = ? AND version >= ? AND version <= ?"
            " ORDER BY version",
            (session_id, from_version, top),
        )

    @_reading
    async def read_all(
        self, after_position: int = 0, limit: int = 1000, session_id: str | None = None
    ) -> list[Event]:
        """Events with position > ``after_position`` in position order."""
        if session_id is None:
            return await self._fetch_events(
                f"SELECT {self._COLUMNS} FROM events WHERE position > ? ORDER BY position LIMIT ?",
                (after_position, limit),
            )
        return await self._fetch_events(
            f"SELECT {self._COLUMNS} FROM events WHERE position > ? AND session_id = ? ORDER BY position LIMIT ?",
            (after_position, session_id, limit),
        )

    @_reading
    async def last_position(self) -> int:
        rows = await self.dialect.fetch("SELECT coalesce(max(position), 0) FROM events", ())
        return int(rows[0][0])

    @_reading
    async def get_blob(self, sha256: str) -> bytes | None:
        rows = await self.dialect.fetch("SELECT data FROM blobs WHERE sha256 = ?", (sha256,))
        return bytes(rows[0][0]) if rows else None

    @_reading
    async def get_session(self, session_id: str) -> SessionRow:
        rows = await self.dialect.fetch(
            f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE id = ?", (session_id,)
        )
        if not rows:
            raise SessionNotFound(session_id)
        return SessionRow(*rows[0])

    @_reading
    async def list_sessions(
        self,
        *,
        status: str | None = None,
        protocol: str | None = None,
        parent_id: str | None = None,
        limit: int = 1000,
        offset: int = 0,
        newest_first: bool = True,
        active_after: float | None = None,
    ) -> list[SessionRow]:
        """Rows of the sessions index, newest first; ``active_after`` keeps sessions
        whose last activity is later than that time."""
        where: list[str] = []
        params: list[Any] = []
        for column, op, value in (
            ("last_active_at", ">", active_after),
            ("status", "=", status),
            ("protocol", "=", protocol),
            ("parent_id", "=", parent_id),
        ):
            if value is not None:
                where.append(f"{column} {op} ?")
                params.append(value)
        sql = f"SELECT {_SESSION_COLUMNS} FROM sessions"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += f" ORDER BY created_at {'DESC' if newest_first else 'ASC'}, id LIMIT ? OFFSET ?"
        rows = await self.dialect.fetch(sql, (*params, limit, offset))
        return [SessionRow(*r) for r in rows]

    @_reading
    async def idle_sessions(self, now: float, default_ttl: float) -> list[SessionRow]:
        """Open sessions whose idle TTL ran out at ``now``."""
        rows = await self.dialect.fetch(
            f"SELECT {_SESSION_COLUMNS} FROM sessions"
            " WHERE status = 'open' AND last_active_at + coalesce(ttl_s, ?) < ?",
            (default_ttl, now),
        )
        return [SessionRow(*r) for r in rows]

    # -- snapshots ---------------------------------------------------------

    @_reading
    async def save_snapshot(
        self, session_id: str, version: int, state: str, data: bytes | None
    ) -> None:
        """Keep one snapshot of the session, this one: a write transaction of the
        writer's (it assigns no position, so it needs no group commit)."""
        sql = self.dialect.sql
        row = (session_id, version, state, data, time.time())

        def work(cur: Any) -> None:
            cur.execute(sql("DELETE FROM snapshots WHERE session_id = ?"), (session_id,))
            cur.execute(
                sql(
                    "INSERT INTO snapshots (session_id, version, state, data, created_at)"
                    " VALUES (?, ?, ?, ?, ?)"
                ),
                row,
            )

        await self.dialect.transaction(work, None)

    @_reading
    async def load_snapshot(
        self, session_id: str, max_version: int | None = None
    ) -> tuple[int, str, bytes | None] | None:
        rows = await self.dialect.fetch(
            "SELECT version, state, data FROM snapshots WHERE session_id = ? AND version <= ?"
            " ORDER BY version DESC LIMIT 1",
            (session_id, 2**31 - 1 if max_version is None else max_version),
        )
        if not rows:
            return None
        version, state, data = rows[0]
        return int(version), str(state), None if data is None else bytes(data)

    async def _read_page(self, after: int, limit: int, session_id: str | None) -> list[Event]:
        return await self.read_all(after, limit=limit, session_id=session_id)

    # -- subscriptions -----------------------------------------------------

    def subscribe(
        self, from_position: int = 0, session_id: str | None = None, *, with_forks: bool = False
    ) -> AsyncIterator[Event]:
        """Events with position > ``from_position``: the past from the log, then live
        (one session's, with ``with_forks`` also the opening of each fork of it)."""
        return self.subscriptions.subscribe(from_position, session_id, with_forks=with_forks)

    def subscribe_batches(
        self, from_position: int = 0, session_id: str | None = None, *, with_forks: bool = False
    ) -> AsyncIterator[list[Event]]:
        """:meth:`subscribe`'s events, each time all that are ready (a committed run together)."""
        return self.subscriptions.subscribe_batches(
            from_position, session_id, with_forks=with_forks
        )


def verify_chain(evs: Sequence[Event], start_hash: str | None = None) -> None:
    """Raise ChainBroken unless ``evs`` (one session, in order) chain correctly."""
    check = ChainCheck(start_hash)
    for e in evs:
        check(e)


class ChainCheck:
    """:func:`verify_chain` an event at a time: call it with each of one session's
    events in order (a loop that hands the event loop back between them)."""

    __slots__ = ("expect_version", "prev")

    def __init__(self, start_hash: str | None = None) -> None:
        self.prev = start_hash
        self.expect_version: int | None = None

    def __call__(self, e: Event) -> None:
        if self.prev is None:
            # A purge tombstone vouches for the head it replaced; otherwise
            # the chain must start at version 1 from the genesis hash.
            if e.type == T.SESSION_PURGED:
                self.prev = e.prev_hash
            elif e.version == 1:
                self.prev = GENESIS_HASH
            else:
                raise ChainBroken(f"{e.session_id}: chain starts at version {e.version}")
        expect = self.expect_version
        if expect is not None and e.version != expect:
            raise ChainBroken(f"{e.session_id}: version {e.version} follows {expect - 1}")
        if e.prev_hash != self.prev:
            raise ChainBroken(
                f"{e.session_id} v{e.version}: prev_hash does not match the previous event"
            )
        if event_hash(e) != e.hash:
            raise ChainBroken(
                f"{e.session_id} v{e.version}: hash does not match the event's content"
            )
        if (
            e.type == T.SESSION_PURGED
            and typed_body(e, SessionPurged).get("last_hash") != e.prev_hash
        ):
            raise ChainBroken(
                f"{e.session_id} v{e.version}: tombstone does not name the purged head"
            )
        self.prev = e.hash
        self.expect_version = e.version + 1
