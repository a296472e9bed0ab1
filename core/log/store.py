"""The event log: one writer task with group commit, readers, subscriptions.

Usage::

    log = await EventLog.open("sqlite+aiosqlite:///./sessiontape.db")
    [e] = await log.append("s1", 0, [NewEvent(T.SESSION_OPENED, {...})])
    async for e in log.subscribe(from_position=0):
        ...
    await log.close()

Appends from every session queue up for the single writer task, which
commits them together (one transaction, one ``executemany``); each appender
awaits its own commit. Only committed events are handed to subscribers or
returned to callers ("durable before visible").

Positions are assigned by the writer inside the write transaction, under
SQLite's write lock or a transaction-scoped advisory lock on PostgreSQL, so
they are gapless and become visible in order (docs/architecture.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import sqlite3
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event as sa_event
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.util import await_only

from core import metrics
from core.errors import (
    ChainBroken,
    ConcurrencyError,
    InvalidArgument,
    InvalidEvent,
    LogClosed,
    SessionNotFound,
)
from core.events import (
    GENESIS_HASH,
    Event,
    NewEvent,
    T,
    canonical_json,
    chain_hash_json,
    event_hash,
    parse_json,
)
from core.log.schema import blobs, events, sessions, snapshots

log = logging.getLogger("sessiontape.log")

PG_LOCK_KEY = 0x5E55_1074  # transaction-scoped advisory lock around position assignment
PG_CHANNEL = "sessiontape_events"
PG_MIGRATE_KEY = 0x5E55_1075

_STATUS_BY_TYPE = {
    T.SESSION_CLOSED: "closed",
    T.SESSION_ABORTED: "aborted",
    T.SESSION_EXPIRED: "expired",
    T.SESSION_PURGED: "purged",
}


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


@dataclass
class _Request:
    kind: str  # "append" | "import" | "purge" | "touch"
    session_id: str
    expected_version: int
    events: Sequence[NewEvent] | Sequence[Event] = ()
    index: Mapping[str, Any] | None = None
    at: float = 0.0
    future: asyncio.Future[list[Event]] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class _Subscriber:
    def __init__(self, session_id: str | None) -> None:
        self.session_id = session_id
        self.queue: asyncio.Queue[Event] = asyncio.Queue(maxsize=10_000)
        self.overflowed = False

    def offer(self, e: Event) -> None:
        if self.session_id is not None and e.session_id != self.session_id:
            return
        try:
            self.queue.put_nowait(e)
        except asyncio.QueueFull:
            self.overflowed = True


class EventLog:
    """The log. Create with :meth:`open`; one instance per process and database."""

    def __init__(self, engine: AsyncEngine, *, batch_max: int = 2000, inline_max_bytes: int = 4096,
                 poll_interval_s: float = 0.5, sqlite_path: str | None = None,
                 sqlite_synchronous: str = "NORMAL") -> None:
        self.engine = engine
        #: SQLite: the writer commits on its own sqlite3 connection, in one thread
        self._sqlite_path = sqlite_path
        self._sqlite_synchronous = sqlite_synchronous
        self._raw: sqlite3.Connection | None = None
        self._write_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sessiontape-log-writer")
        self.dialect = engine.dialect.name
        self.batch_max = batch_max
        self.inline_max_bytes = inline_max_bytes
        self.poll_interval_s = poll_interval_s
        self._queue: asyncio.Queue[_Request | None] = asyncio.Queue()
        self._heads: OrderedDict[str, tuple[int, str]] = OrderedDict()
        self._subscribers: set[_Subscriber] = set()
        self._writer: asyncio.Task[None] | None = None
        self._tailer: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._listen_conn: AsyncConnection | None = None
        self._published = 0
        self._closing = False
        #: read other processes' commits by polling/notification (always on
        #: PostgreSQL; on SQLite for read-only followers such as `replay --follow`)
        self._tail = False
        #: PostgreSQL: the connection holding this process's session writer locks
        self._lock_conn: AsyncConnection | None = None
        self._lock_mutex = asyncio.Lock()
        #: test hook: awaited inside the write transaction, just before COMMIT
        self.before_commit: Callable[[list[Event]], Awaitable[None]] | None = None

    # -- lifecycle ---------------------------------------------------------

    @classmethod
    async def open(cls, url: str, *, migrate: bool = True, echo: bool = False,
                   batch_max: int = 2000, inline_max_bytes: int = 4096,
                   poll_interval_s: float = 0.5, sqlite_synchronous: str = "NORMAL",
                   follow: bool = False) -> EventLog:
        """Connect, migrate a fresh database to head, and start the writer.

        ``follow`` makes subscriptions see other processes' commits on SQLite
        too (by polling); PostgreSQL always does (LISTEN/NOTIFY plus polling).
        """
        kwargs: dict[str, Any] = {"echo": echo}
        if url.startswith("sqlite"):
            kwargs["connect_args"] = {"timeout": 30}
        engine = create_async_engine(url, **kwargs)
        sqlite_path: str | None = None
        if engine.dialect.name == "sqlite":
            sync_mode = sqlite_synchronous

            def _pragmas(dbapi_conn: Any, _rec: Any) -> None:
                cur = dbapi_conn.cursor()
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute(f"PRAGMA synchronous={sync_mode}")
                cur.execute("PRAGMA foreign_keys=ON")
                cur.close()

            sa_event.listen(engine.sync_engine, "connect", _pragmas)
            sqlite_path = engine.url.database or ":memory:"

        self = cls(engine, batch_max=batch_max, inline_max_bytes=inline_max_bytes,
                   poll_interval_s=poll_interval_s, sqlite_path=sqlite_path,
                   sqlite_synchronous=sqlite_synchronous)
        if migrate:
            from migrations.runner import upgrade_connection

            async with engine.begin() as conn:
                if engine.dialect.name == "postgresql":
                    # several servers starting on a fresh database migrate one at a time
                    await conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": PG_MIGRATE_KEY})
                await conn.run_sync(upgrade_connection)
        await self._start(follow)
        return self

    async def _start(self, follow: bool = False) -> None:
        self._tail = self.dialect == "postgresql" or follow
        if self._tail:
            async with self.engine.connect() as conn:
                self._published = int((await conn.execute(sa.select(sa.func.coalesce(sa.func.max(events.c.position), 0)))).scalar_one())
            self._tailer = asyncio.create_task(self._tail_loop(), name="sessiontape-log-tailer")
        if self.dialect == "postgresql":
            self._listen_conn = await self.engine.connect()
            raw = await self._listen_conn.get_raw_connection()
            await raw.driver_connection.add_listener(PG_CHANNEL, lambda *_: self._wake.set())  # type: ignore[union-attr]
        self._writer = asyncio.create_task(self._write_loop(), name="sessiontape-log-writer")

    async def close(self) -> None:
        """Commit what is queued, refuse what comes after, stop."""
        if self._writer is not None:
            self._closing = True
            await self._queue.put(None)
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer
            self._writer = None
            while not self._queue.empty():
                left = self._queue.get_nowait()
                if left is not None and not left.future.done():
                    left.future.set_exception(LogClosed("the event log closed before this append committed"))
        if self._tailer is not None:
            self._tailer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._tailer
            self._tailer = None
        if self._listen_conn is not None:
            with contextlib.suppress(Exception):
                await self._listen_conn.close()
            self._listen_conn = None
        if self._lock_conn is not None:
            with contextlib.suppress(Exception):
                await self._lock_conn.close()
            self._lock_conn = None
        self._write_thread.submit(self._close_raw).result()
        self._write_thread.shutdown(wait=True)
        await self.engine.dispose()

    # -- writing -----------------------------------------------------------

    async def append(self, session_id: str, expected_version: int, new_events: Sequence[NewEvent],
                     *, index: Mapping[str, Any] | None = None) -> list[Event]:
        """Append ``new_events`` after ``expected_version``; returns them committed.

        Raises :class:`ConcurrencyError` (nothing written) when the session's
        current version is not ``expected_version``. ``index`` carries
        sessions-table columns the caller knows (``history_length``).
        """
        if not new_events:
            return []
        return await self._submit(_Request("append", session_id, expected_version, list(new_events), index))

    async def touch(self, session_id: str, at: float | None = None) -> None:
        """Refresh a session's idle clock without an event."""
        await self._submit(_Request("touch", session_id, -1, (), None, at or time.time()))

    async def import_events(self, evs: Sequence[Event], *, index: Mapping[str, Any] | None = None) -> list[Event]:
        """Insert exported events verbatim (new positions, same chain).

        Raises ChainBroken (nothing written) when the events do not chain, and
        ConcurrencyError when the session already has events.
        """
        if not evs:
            return []
        sid = evs[0].session_id
        if any(e.session_id != sid for e in evs):
            raise InvalidEvent("an import batch must hold one session")
        verify_chain(evs)
        return await self._submit(_Request("import", sid, evs[0].version - 1, list(evs), index))

    async def purge(self, session_id: str, reason: str = "retention") -> Event:
        """Delete a session's events, leaving a ``session.purged`` tombstone."""
        row = await self.get_session(session_id)
        req = _Request("purge", session_id, row.version, [NewEvent(T.SESSION_PURGED, {"reason": reason})])
        return (await self._submit(req))[0]

    # -- one writer per session across processes -----------------------------

    @property
    def shared(self) -> bool:
        """Whether other server processes may write to this database (PostgreSQL)."""
        return self.dialect == "postgresql"

    async def try_lock_session(self, session_id: str) -> bool:
        """Take the cross-process writer lock of a session (a generation holds it).

        PostgreSQL: a session-level advisory lock on one connection kept for
        all of this process's locks, so a process that dies releases them with
        its connection. False when another process holds it. SQLite has one
        writing process: always True.
        """
        if self.dialect != "postgresql":
            return True
        async with self._lock_mutex:
            conn = await self._lock_connection()
            got = (await conn.execute(sa.text("SELECT pg_try_advisory_lock(:k)"),
                                      {"k": session_lock_key(session_id)})).scalar()
        return bool(got)

    async def unlock_session(self, session_id: str) -> None:
        if self.dialect != "postgresql":
            return
        async with self._lock_mutex:
            conn = self._lock_conn
            if conn is None:
                return  # the connection went away, and its locks with it
            try:
                await conn.execute(sa.text("SELECT pg_advisory_unlock(:k)"), {"k": session_lock_key(session_id)})
            except Exception:
                log.warning("releasing the writer lock of %s failed; dropping the lock connection", session_id)
                self._lock_conn = None
                with contextlib.suppress(Exception):
                    await conn.close()

    async def _lock_connection(self) -> AsyncConnection:
        if self._lock_conn is None:
            conn = await self.engine.connect()
            self._lock_conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
        return self._lock_conn

    async def _submit(self, req: _Request) -> list[Event]:
        if self._writer is None or self._closing:
            raise LogClosed("the event log is closed")
        await self._queue.put(req)
        return await req.future

    async def _write_loop(self) -> None:
        while True:
            first = await self._queue.get()
            if first is None:
                return
            batch, n = [first], len(first.events)
            stop = False
            while n < self.batch_max and not self._queue.empty():
                nxt = self._queue.get_nowait()
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
                n += len(nxt.events)
            await self._commit_batch(batch)
            if stop:
                return

    async def _commit_batch(self, batch: list[_Request]) -> None:
        t0 = time.perf_counter()
        try:
            results = await self._run_tx(batch)
        except Exception as exc:
            # Something in the batch failed (a conflict with another process,
            # a stale cache, one bad request): retry each request alone so
            # only the guilty one fails.
            self._heads.clear()
            if len(batch) == 1:
                self._fail(batch[0], exc)
                return
            for req in batch:
                try:
                    res = await self._run_tx([req])
                except Exception as one_exc:
                    self._heads.pop(req.session_id, None)
                    self._fail(req, one_exc)
                else:
                    self._finish([req], [res[0]], t0)
            return
        self._finish(batch, results, t0)

    def _fail(self, req: _Request, exc: BaseException) -> None:
        dbapi = self.engine.dialect.dbapi
        if isinstance(exc, IntegrityError | sqlite3.IntegrityError) or (
                dbapi is not None and isinstance(exc, dbapi.IntegrityError)):
            exc = ConcurrencyError(f"session {req.session_id}: concurrent append (version conflict)")
        elif isinstance(exc, DBAPIError) and not isinstance(exc, OperationalError):
            exc = InvalidArgument(f"session {req.session_id}: the database refused the write: {exc.orig}")
        if not req.future.done():
            req.future.set_exception(exc)

    def _finish(self, batch: list[_Request], results: list[list[Event]], t0: float) -> None:
        all_events: list[Event] = []
        for req, evs in zip(batch, results, strict=True):
            all_events.extend(evs)
            if not req.future.done():
                req.future.set_result(evs)
        if all_events:
            metrics.EVENTS_APPENDED.inc(len(all_events))
            metrics.COMMIT_SECONDS.observe(time.perf_counter() - t0)
            metrics.BATCH_SIZE.observe(len(all_events))
            if self._tail:
                if self._subscribers:
                    self._wake.set()
                else:
                    # Nobody listens: skip reading our own writes back. A new
                    # subscriber catches up from the database anyway.
                    self._published = max(self._published, all_events[-1].position)
            else:
                self._publish(all_events)

    def _head(self, cur: Any, session_id: str) -> tuple[int, str] | None:
        head = self._heads.get(session_id)
        if head is not None:
            self._heads.move_to_end(session_id)
            return head
        cur.execute(self._sql("SELECT version, head_hash FROM sessions WHERE id = ?"), (session_id,))
        row = cur.fetchone()
        if row is None:
            return None
        return int(row[0]), str(row[1])

    def _remember(self, session_id: str, head: tuple[int, str]) -> None:
        self._heads[session_id] = head
        self._heads.move_to_end(session_id)
        while len(self._heads) > 100_000:
            self._heads.popitem(last=False)

    async def _run_tx(self, batch: list[_Request]) -> list[list[Event]]:
        """One transaction for ``batch``. The whole transaction is one synchronous
        function: on SQLite it runs in the writer thread on its own connection
        (one thread hop per commit instead of one per statement); on PostgreSQL
        it runs through ``run_sync`` on an asyncpg connection."""
        if self._sqlite_path is not None:
            loop = asyncio.get_running_loop()
            results = await loop.run_in_executor(self._write_thread, self._tx_sync, loop, batch)
        else:
            async with self.engine.connect() as conn:
                results = await conn.run_sync(self._tx_pg, batch)
        for evs in results:
            if evs:
                self._remember(evs[-1].session_id, (evs[-1].version, evs[-1].hash))
        return results

    def _tx_sync(self, loop: asyncio.AbstractEventLoop, batch: list[_Request]) -> list[list[Event]]:
        """SQLite, in the writer thread: one transaction on the writer's own connection."""
        raw = self._raw
        if raw is None:
            raw = self._raw = self._raw_connect()
        # IMMEDIATE takes the write lock now, so MAX(position) is read under it
        raw.execute("BEGIN IMMEDIATE")
        try:
            results = self._write(raw.cursor(), batch)
            hook = self.before_commit
            if hook is not None:  # run the test hook on the loop and wait for it
                asyncio.run_coroutine_threadsafe(hook([e for r in results for e in r]), loop).result()  # type: ignore[arg-type]
            raw.execute("COMMIT")
        except BaseException:
            if raw.in_transaction:
                raw.execute("ROLLBACK")
            raise
        return results

    def _close_raw(self) -> None:
        if self._raw is not None:
            self._raw.close()
            self._raw = None

    def _raw_connect(self) -> sqlite3.Connection:
        assert self._sqlite_path is not None
        raw = sqlite3.connect(self._sqlite_path, timeout=30, isolation_level=None, check_same_thread=False)
        raw.execute("PRAGMA journal_mode=WAL")
        raw.execute(f"PRAGMA synchronous={self._sqlite_synchronous}")
        raw.execute("PRAGMA foreign_keys=ON")
        return raw

    def _tx_pg(self, conn: sa.Connection, batch: list[_Request]) -> list[list[Event]]:
        """PostgreSQL, inside ``run_sync``: the same statements on the asyncpg connection."""
        tx = conn.begin()
        try:
            results = self._write(conn.connection.dbapi_connection.cursor(), batch)  # type: ignore[union-attr]
            hook = self.before_commit
            if hook is not None:
                await_only(hook([e for r in results for e in r]))
            tx.commit()
        except BaseException:
            tx.rollback()
            raise
        return results

    def _write(self, cur: Any, batch: list[_Request]) -> list[list[Event]]:
        """The batch's statements on a DBAPI cursor, inside the caller's transaction.

        Plain SQL on the driver's cursor: SQLAlchemy's per-statement machinery
        costs more than the statements themselves on this path.
        """
        if self.dialect == "postgresql":
            cur.execute(self._sql("SELECT pg_advisory_xact_lock(?)"), (PG_LOCK_KEY,))
        cur.execute("SELECT COALESCE(MAX(position), 0) FROM events")
        pos = int(cur.fetchone()[0])
        now = time.time()
        rows: list[tuple[Any, ...]] = []
        blob_rows: dict[str, dict[str, Any]] = {}
        results: list[list[Event]] = []
        pending: dict[str, tuple[int, str]] = {}
        new_sessions: dict[str, dict[str, Any]] = {}
        updates: dict[str, dict[str, Any]] = {}
        inline_max = self.inline_max_bytes
        for req in batch:
            sid = req.session_id
            head = pending.get(sid) or self._head(cur, sid)
            if req.kind == "touch":
                if head is not None:
                    upd = updates.setdefault(sid, {"n": 0})
                    upd["last_active_at"] = req.at
                results.append([])
                continue
            cur_version = head[0] if head else 0
            if req.kind != "purge" and cur_version != req.expected_version and sid not in pending \
                    and self._heads.pop(sid, None) is not None:
                # the cached head may be stale (another process wrote): ask the database
                head = self._head(cur, sid)
                cur_version = head[0] if head else 0
            if req.kind != "purge" and cur_version != req.expected_version:
                raise ConcurrencyError(
                    f"session {sid}: expected version {req.expected_version}, log is at {cur_version}"
                )
            if req.kind == "purge" and head is None:
                raise SessionNotFound(sid)
            prev = head[1] if head else GENESIS_HASH
            out: list[Event] = []
            if req.kind == "import":
                for e in req.events:
                    assert isinstance(e, Event)
                    if e.prev_hash != prev:
                        raise ChainBroken(f"import of {sid} v{e.version} does not continue the chain")
                    pos += 1
                    ev = Event(pos, sid, e.version, e.type, e.body, e.data, e.recorded_at, e.hash, e.prev_hash)
                    out.append(ev)
                    rows.append(self._row(ev, canonical_json(ev.body), blob_rows, now, inline_max))
                    prev = e.hash
            else:
                version = cur_version
                if req.kind == "purge":
                    cur.execute(self._sql("DELETE FROM events WHERE session_id = ?"), (sid,))
                    cur.execute(self._sql("DELETE FROM snapshots WHERE session_id = ?"), (sid,))
                for ne in req.events:
                    assert isinstance(ne, NewEvent)
                    body = ne.body
                    if req.kind == "purge":
                        body = {**body, "through_version": cur_version, "last_hash": prev}
                    version += 1
                    pos += 1
                    body_json = canonical_json(body)
                    h = chain_hash_json(prev, sid, version, ne.type, body_json, ne.data, now)
                    # The body as a reader of the log will see it (lists, not
                    # tuples; null for non-finite floats): live == replay.
                    ev = Event(pos, sid, version, ne.type, parse_json(body_json), ne.data, now, h, prev)
                    out.append(ev)
                    rows.append(self._row(ev, body_json, blob_rows, now, inline_max))
                    prev = h
            if out:
                self._index(req, head, out, now, new_sessions, updates)
                pending[sid] = (out[-1].version, out[-1].hash)
            results.append(out)
        if blob_rows:
            self._put_blobs(cur, list(blob_rows.values()))
        if new_sessions:
            cols = [c.name for c in sessions.columns]
            cur.executemany(self._sql(f"INSERT INTO sessions ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})"),
                            [tuple(row[c] for c in cols) for row in new_sessions.values()])
        if rows:
            cur.executemany(self._insert_sql, rows)
        if updates:
            self._apply_updates(cur, updates)
        if self.dialect == "postgresql" and rows:
            cur.execute(self._sql("SELECT pg_notify(?, ?)"), (PG_CHANNEL, str(pos)))
        return results

    @property
    def _insert_sql(self) -> str:
        cols = "position, session_id, version, type, body, data, blob_sha, recorded_at, hash, prev_hash"
        marks = ", ".join(f"${i}" for i in range(1, 11)) if self.dialect == "postgresql" else ", ".join("?" * 10)
        return f"INSERT INTO events ({cols}) VALUES ({marks})"

    @staticmethod
    def _row(e: Event, body_json: str, blob_rows: dict[str, dict[str, Any]], now: float,
             inline_max: int) -> tuple[Any, ...]:
        data, blob_sha = e.data, None
        if data is not None and len(data) > inline_max:
            blob_sha = hashlib.sha256(data).hexdigest()
            blob_rows[blob_sha] = {"sha256": blob_sha, "size": len(data), "data": data, "created_at": now}
            data = None
        return (e.position, e.session_id, e.version, e.type, body_json, data, blob_sha, e.recorded_at,
                e.hash, e.prev_hash)

    def _put_blobs(self, cur: Any, rows: list[dict[str, Any]]) -> None:
        shas = [r["sha256"] for r in rows]
        cur.execute(self._sql(f"SELECT sha256 FROM blobs WHERE sha256 IN ({', '.join('?' * len(shas))})"), shas)
        have = {r[0] for r in cur.fetchall()}
        fresh = [(r["sha256"], r["size"], r["data"], r["created_at"]) for r in rows if r["sha256"] not in have]
        if fresh:
            cur.executemany(self._sql("INSERT INTO blobs (sha256, size, data, created_at) VALUES (?, ?, ?, ?)"), fresh)

    def _index(self, req: _Request, head: tuple[int, str] | None, out: list[Event], now: float,
               new_sessions: dict[str, dict[str, Any]], updates: dict[str, dict[str, Any]]) -> None:
        """Fold this request into the batch's sessions-table writes (one per session)."""
        sid = req.session_id
        last = out[-1]
        values: dict[str, Any] = {"version": last.version, "head_hash": last.hash,
                                  "updated_at": last.recorded_at, "last_active_at": now}
        for e in out:
            st = _STATUS_BY_TYPE.get(e.type)
            if st is not None:
                values["status"] = st
        if req.index:
            values.update({k: v for k, v in req.index.items() if k in ("history_length", "status", "last_active_at")})
        if req.kind == "import":
            values["last_active_at"] = last.recorded_at
        if head is None and sid not in new_sessions:
            opened = out[0] if out[0].type == T.SESSION_OPENED else None
            if opened is None or opened.version != 1:
                raise InvalidEvent(f"session {sid}: the first event must be session.opened")
            b = opened.body
            eng = b.get("engine", {}) or {}
            parent = b.get("parent") or {}
            row = {
                "id": sid, "protocol": str(b.get("protocol", "")), "status": "open",
                "label": str(b.get("label", "")), "engine": str(eng.get("engine", "")),
                "model_id": str(eng.get("model_id", "")), "parent_id": parent.get("session_id"),
                "parent_version": parent.get("version"), "fork_position": parent.get("token_position"),
                "created_at": opened.recorded_at, "ttl_s": b.get("ttl_s"), "event_count": len(out),
                "history_length": 0,
            }
            row.update(values)
            new_sessions[sid] = row
            return
        if sid in new_sessions:
            row = new_sessions[sid]
            row.update(values)
            row["event_count"] += len(out)
            return
        upd = updates.setdefault(sid, {"n": 0})
        if req.kind == "purge":
            upd["reset"] = True
            upd["n"] = len(out)
            values.setdefault("history_length", 0)
        else:
            upd["n"] += len(out)
        upd.update(values)

    def _apply_updates(self, cur: Any, updates: dict[str, dict[str, Any]]) -> None:
        """One executemany for every touched session: columns not given keep their value."""
        pg = self.dialect == "postgresql"

        def p(i: int) -> str:
            return f"${i}" if pg else "?"

        sql = (
            "UPDATE sessions SET "
            f"version = COALESCE({p(1)}, version), head_hash = COALESCE({p(2)}, head_hash), "
            f"updated_at = COALESCE({p(3)}, updated_at), last_active_at = COALESCE({p(4)}, last_active_at), "
            f"status = COALESCE({p(5)}, status), history_length = COALESCE({p(6)}, history_length), "
            f"event_count = CASE WHEN {p(7)} THEN {p(8)} ELSE event_count + {p(9)} END "
            f"WHERE id = {p(10)}"
        )
        params = [
            (u.get("version"), u.get("head_hash"), u.get("updated_at"), u.get("last_active_at"), u.get("status"),
             u.get("history_length"), bool(u.get("reset")), u["n"], u["n"], sid)
            for sid, u in updates.items()
        ]
        cur.executemany(sql, params)

    # -- reading -----------------------------------------------------------

    _COLUMNS = "position, session_id, version, type, body, data, blob_sha, recorded_at, hash, prev_hash"

    def _sql(self, text: str) -> str:
        """``text`` with ``?`` placeholders in the driver's own style (the read
        and write hot paths bypass SQLAlchemy's per-row processing)."""
        if self.dialect != "postgresql":
            return text
        parts = text.split("?")
        return "".join(p + (f"${i}" if i < len(parts) else "") for i, p in enumerate(parts, 1))

    async def _fetch_events(self, sql: str, params: tuple[Any, ...]) -> list[Event]:
        async with self.engine.connect() as conn:
            rows: Sequence[Any] = (await conn.exec_driver_sql(self._sql(sql), params)).all()
            shas = {r[6] for r in rows if r[6] is not None}
            blob_data: dict[str, bytes] = {}
            if shas:
                for sha, data in await conn.execute(
                        sa.select(blobs.c.sha256, blobs.c.data).where(blobs.c.sha256.in_(shas))):
                    blob_data[sha] = bytes(data)
        loads = parse_json
        out = []
        for pos, sid, version, type_, body, data, blob_sha, recorded_at, h, prev in rows:
            if blob_sha is not None:
                data = blob_data[blob_sha]
            elif data is not None:
                data = bytes(data)
            out.append(Event(pos, sid, version, type_, loads(body), data, recorded_at, h, prev))
        return out

    async def read(self, session_id: str, from_version: int = 1, to_version: int | None = None) -> list[Event]:
        """A session's events in version order, ``from_version`` to ``to_version`` inclusive."""
        top = 2**31 - 1 if to_version is None else to_version
        return await self._fetch_events(
            f"SELECT {self._COLUMNS} FROM events WHERE session_id = ? AND version >= ? AND version <= ?"
            " ORDER BY version", (session_id, from_version, top))

    async def read_all(self, after_position: int = 0, limit: int = 1000,
                       session_id: str | None = None) -> list[Event]:
        """Events with position > ``after_position`` in position order."""
        if session_id is None:
            return await self._fetch_events(
                f"SELECT {self._COLUMNS} FROM events WHERE position > ? ORDER BY position LIMIT ?",
                (after_position, limit))
        return await self._fetch_events(
            f"SELECT {self._COLUMNS} FROM events WHERE position > ? AND session_id = ? ORDER BY position LIMIT ?",
            (after_position, session_id, limit))

    async def last_position(self) -> int:
        async with self.engine.connect() as conn:
            return int((await conn.execute(sa.select(sa.func.coalesce(sa.func.max(events.c.position), 0)))).scalar_one())

    async def get_blob(self, sha256: str) -> bytes | None:
        async with self.engine.connect() as conn:
            data = (await conn.execute(sa.select(blobs.c.data).where(blobs.c.sha256 == sha256))).scalar()
            return None if data is None else bytes(data)

    async def get_session(self, session_id: str) -> SessionRow:
        async with self.engine.connect() as conn:
            row = (await conn.execute(sa.select(sessions).where(sessions.c.id == session_id))).first()
        if row is None:
            raise SessionNotFound(session_id)
        return SessionRow(**row._mapping)

    async def list_sessions(self, *, status: str | None = None, protocol: str | None = None,
                            parent_id: str | None = None, limit: int = 1000, offset: int = 0,
                            newest_first: bool = True, active_after: float | None = None) -> list[SessionRow]:
        """Rows of the sessions index, newest first; ``active_after`` keeps sessions
        whose last activity is later than that time."""
        q = sa.select(sessions)
        if active_after is not None:
            q = q.where(sessions.c.last_active_at > active_after)
        if status is not None:
            q = q.where(sessions.c.status == status)
        if protocol is not None:
            q = q.where(sessions.c.protocol == protocol)
        if parent_id is not None:
            q = q.where(sessions.c.parent_id == parent_id)
        order = sessions.c.created_at.desc() if newest_first else sessions.c.created_at.asc()
        q = q.order_by(order, sessions.c.id).limit(limit).offset(offset)
        async with self.engine.connect() as conn:
            return [SessionRow(**r._mapping) for r in (await conn.execute(q)).all()]

    async def idle_sessions(self, now: float, default_ttl: float) -> list[SessionRow]:
        """Open sessions whose idle TTL ran out at ``now``."""
        ttl = sa.func.coalesce(sessions.c.ttl_s, default_ttl)
        q = sa.select(sessions).where(sessions.c.status == "open", sessions.c.last_active_at + ttl < now)
        async with self.engine.connect() as conn:
            return [SessionRow(**r._mapping) for r in (await conn.execute(q)).all()]

    # -- snapshots ---------------------------------------------------------

    async def save_snapshot(self, session_id: str, version: int, state: str, data: bytes | None) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(snapshots.delete().where(snapshots.c.session_id == session_id))
            await conn.execute(snapshots.insert().values(
                session_id=session_id, version=version, state=state, data=data, created_at=time.time()))

    async def load_snapshot(self, session_id: str, max_version: int | None = None) -> tuple[int, str, bytes | None] | None:
        q = sa.select(snapshots.c.version, snapshots.c.state, snapshots.c.data).where(snapshots.c.session_id == session_id)
        if max_version is not None:
            q = q.where(snapshots.c.version <= max_version)
        async with self.engine.connect() as conn:
            row = (await conn.execute(q.order_by(snapshots.c.version.desc()).limit(1))).first()
        if row is None:
            return None
        return int(row[0]), str(row[1]), None if row[2] is None else bytes(row[2])

    # -- subscriptions -----------------------------------------------------

    def _publish(self, evs: list[Event]) -> None:
        for e in evs:
            self._published = max(self._published, e.position)
            for sub in list(self._subscribers):
                sub.offer(e)

    async def _tail_loop(self) -> None:
        """PostgreSQL: pick up committed events from every process, in position order."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_interval_s)
            self._wake.clear()
            if not self._subscribers:
                continue
            try:
                while True:
                    evs = await self.read_all(self._published, limit=1000)
                    if evs:
                        self._publish(evs)
                    if len(evs) < 1000:
                        break
            except Exception:
                log.exception("tailing the log failed; retrying")
                await asyncio.sleep(self.poll_interval_s)

    async def subscribe(self, from_position: int = 0, session_id: str | None = None) -> AsyncIterator[Event]:
        """Events with position > ``from_position``: the past from the log, then live."""
        sub = _Subscriber(session_id)
        self._subscribers.add(sub)
        metrics.SUBSCRIBERS.inc()
        last = from_position
        try:
            while True:
                # catch up from the database
                while True:
                    evs = await self.read_all(last, limit=1000, session_id=session_id)
                    for e in evs:
                        yield e
                        last = e.position
                    if len(evs) < 1000:
                        break
                sub.overflowed = False
                # live
                while not sub.overflowed:
                    e = await sub.queue.get()
                    if e.position <= last:
                        continue
                    yield e
                    last = e.position
                while not sub.queue.empty():
                    sub.queue.get_nowait()
        finally:
            self._subscribers.discard(sub)
            metrics.SUBSCRIBERS.dec()


def session_lock_key(session_id: str) -> int:
    """The 64-bit advisory-lock key of a session's writer lock."""
    return int.from_bytes(hashlib.sha256(b"sessiontape-writer:" + session_id.encode()).digest()[:8], "big",
                          signed=True)


def verify_chain(evs: Sequence[Event], start_hash: str | None = None) -> None:
    """Raise ChainBroken unless ``evs`` (one session, in order) chain correctly."""
    prev = start_hash
    expect_version: int | None = None
    for e in evs:
        if prev is None:
            # A purge tombstone vouches for the head it replaced; otherwise
            # the chain must start at version 1 from the genesis hash.
            if e.type == T.SESSION_PURGED:
                prev = e.prev_hash
            elif e.version == 1:
                prev = GENESIS_HASH
            else:
                raise ChainBroken(f"{e.session_id}: chain starts at version {e.version}")
        if expect_version is not None and e.version != expect_version:
            raise ChainBroken(f"{e.session_id}: version {e.version} follows {expect_version - 1}")
        if e.prev_hash != prev:
            raise ChainBroken(f"{e.session_id} v{e.version}: prev_hash does not match the previous event")
        if event_hash(e) != e.hash:
            raise ChainBroken(f"{e.session_id} v{e.version}: hash does not match the event's content")
        if e.type == T.SESSION_PURGED and e.body.get("last_hash") != e.prev_hash:
            raise ChainBroken(f"{e.session_id} v{e.version}: tombstone does not name the purged head")
        prev = e.hash
        expect_version = e.version + 1
