"""The writer's planning: a batch of requests made into rows, hashes and index
writes, and the statements that write a plan inside a transaction.

A plan is made from what the writer knows (cached session heads and the log's
end) or inside the transaction with the database at hand; either way the same
:meth:`Planner.plan` numbers, hashes and encodes each request's events by its
kind (:class:`RequestKind`), and :meth:`Planner.apply` writes them.
:func:`batch_args` gives a plain plan as the arguments of PostgreSQL's
one-call append (:meth:`Dialect.append_batch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import repeat
from typing import Any, cast

import orjson

from sessiontape.core.bodies import SessionOpened, SessionPurged, body, session_purged
from sessiontape.core.errors import ChainBroken, ConcurrencyError, InvalidEvent, SessionNotFound
from sessiontape.core.events import (
    GENESIS_HASH,
    Event,
    Hasher,
    NewEvent,
    T,
    canonical_json,
    chain_hashers,
)
from sessiontape.core.log.dialect import Dialect
from sessiontape.core.log.schema import sessions

#: builds an Event from a ready tuple of its fields (skips the keyword handling of
#: the NamedTuple's constructor on the hot path)
new_event = tuple.__new__

#: the events table's columns in the order of the writer's rows, for events
#: without data: ``data`` and ``blob_sha`` are left to their NULL default, since
#: binding None costs sqlite3 more than a string (about 1 us each: it looks
#: for an adapter first), as much as the rest of the row together
EVENT_COLUMNS = (
    "position",
    "session_id",
    "version",
    "type",
    "body",
    "recorded_at",
    "hash",
    "prev_hash",
)
#: the same, for events with data (inline, or in the blobs table by ``blob_sha``)
EVENT_DATA_COLUMNS = (*EVENT_COLUMNS, "data", "blob_sha")

#: the sessions-index columns an append may set (each only when it changes)
UPDATABLE = ("version", "head_hash", "updated_at", "last_active_at", "status", "history_length")

_STATUS_BY_TYPE = {
    T.SESSION_CLOSED: "closed",
    T.SESSION_ABORTED: "aborted",
    T.SESSION_EXPIRED: "expired",
    T.SESSION_PURGED: "purged",
}


class RequestKind(StrEnum):
    """What a writer request does (planned each its own way: :meth:`Planner.plan`)."""

    #: new events after the session's expected version
    APPEND = "append"
    #: events copied from another log, hashes kept (their chain must continue)
    IMPORT = "import"
    #: the session's events replaced by one tombstone
    PURGE = "purge"
    #: only the session's idle clock moves (no event)
    TOUCH = "touch"


HeadOf = Callable[[Any, str], "tuple[int, str] | None"]


@dataclass
class Request:
    """One caller's write, queued for the writer."""

    kind: RequestKind
    session_id: str
    expected_version: int
    events: Sequence[NewEvent] | Sequence[Event] = ()
    index: Mapping[str, Any] | None = None
    at: float = 0.0
    future: asyncio.Future[list[Event]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


@dataclass
class Plan:
    """A batch made ready to write: what :meth:`Planner.apply` sends to the database."""

    #: the log's last position the plan follows
    start: int
    end: int = 0
    #: events without data (:data:`EVENT_COLUMNS`)
    rows: list[tuple[Any, ...]] = field(default_factory=list)
    #: events with data (:data:`EVENT_DATA_COLUMNS`)
    data_rows: list[tuple[Any, ...]] = field(default_factory=list)
    blob_rows: dict[str, dict[str, Any]] = field(default_factory=dict)
    results: list[list[Event]] = field(default_factory=list)
    new_sessions: dict[str, dict[str, Any]] = field(default_factory=dict)
    updates: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: sessions whose events and snapshots are deleted first
    purged: list[str] = field(default_factory=list)
    #: the (version, hash) of each session the plan appends to, after it
    heads: dict[str, tuple[int, str]] = field(default_factory=dict)


class CacheMiss(Exception):
    """Planning needs the database: a session head this writer does not know."""


class Moved(Exception):
    """Another process wrote after a plan was made from the cache."""


class Planner:
    """Makes plans and writes them (the writer holds one)."""

    def __init__(self, dialect: Dialect, inline_max_bytes: int) -> None:
        self.dialect = dialect
        self.inline_max_bytes = inline_max_bytes

    def plan(
        self, cur: Any, batch: list[Request], pos: int, head_of: HeadOf, *, recheck: HeadOf | None
    ) -> Plan:
        """Number, hash and encode the batch's events after position ``pos``.

        ``head_of(cur, session_id)`` gives a session's (version, hash) before
        this batch; ``recheck`` a fresher one when the version does not match
        (None: no fresher one exists).
        """
        now = time.time()
        plan = Plan(start=pos)
        hashers = chain_hashers(now)
        for req in batch:
            sid = req.session_id
            head = plan.heads.get(sid) or head_of(cur, sid)
            if req.kind == RequestKind.TOUCH:
                if head is not None:
                    plan.updates.setdefault(sid, {"n": 0})["last_active_at"] = req.at
                plan.results.append([])
                continue
            if req.kind == RequestKind.PURGE or (head[0] if head else 0) != req.expected_version:
                head = self._checked_head(cur, req, head, sid in plan.heads, recheck)
            if req.kind == RequestKind.IMPORT:
                out = self._imported(plan, req, head, pos, now)
            else:
                out = self._appended(plan, req, head, pos, now, hashers(sid))
            pos += len(out)
            if out:
                self._index(req, head, out, now, plan.new_sessions, plan.updates)
                plan.heads[sid] = (out[-1].version, out[-1].hash)
            plan.results.append(out)
        plan.end = pos
        return plan

    @staticmethod
    def _checked_head(
        cur: Any,
        req: Request,
        head: tuple[int, str] | None,
        pending: bool,
        recheck: HeadOf | None,
    ) -> tuple[int, str] | None:
        """The session's head, checked against the request's expected version (a fresher
        one asked for first when they differ); raises what a mismatch means."""
        sid = req.session_id
        version = head[0] if head else 0
        purge = req.kind == RequestKind.PURGE
        if not purge and version != req.expected_version and not pending and recheck is not None:
            with contextlib.suppress(CacheMiss):
                head = recheck(cur, sid)
                version = head[0] if head else 0
        if not purge and version != req.expected_version:
            raise ConcurrencyError(
                f"session {sid}: expected version {req.expected_version}, log is at {version}"
            )
        if purge and head is None:
            raise SessionNotFound(sid)
        return head

    def _imported(
        self, plan: Plan, req: Request, head: tuple[int, str] | None, pos: int, now: float
    ) -> list[Event]:
        """An import's events at the next positions, their chain checked and kept."""
        sid = req.session_id
        prev = head[1] if head else GENESIS_HASH
        out: list[Event] = []
        for e in req.events:
            assert isinstance(e, Event)
            if e.prev_hash != prev:
                raise ChainBroken(f"import of {sid} v{e.version} does not continue the chain")
            pos += 1
            ev = e._replace(position=pos)
            out.append(ev)
            self._row(plan, ev, canonical_json(ev.body), now, self.inline_max_bytes)
            prev = e.hash
        return out

    def _appended(
        self,
        plan: Plan,
        req: Request,
        head: tuple[int, str] | None,
        pos: int,
        now: float,
        hasher: Hasher,
    ) -> list[Event]:
        """An append's (or a purge's tombstone's) events: numbered, hashed, encoded."""
        sid = req.session_id
        version = head[0] if head else 0
        prev = head[1] if head else GENESIS_HASH
        if not all(map(isinstance, req.events, repeat(NewEvent))):
            raise InvalidEvent(f"session {sid}: append takes NewEvents")
        events = cast("Sequence[NewEvent]", req.events)
        if req.kind == RequestKind.PURGE:
            plan.purged.append(sid)
            (ne,) = events
            tombstone = session_purged(body(ne, SessionPurged)["reason"], version, prev)
            events = [NewEvent(ne.type, tombstone, ne.data)]
        rows, inline_max, loads = plan.rows, self.inline_max_bytes, orjson.loads
        out: list[Event] = []
        # the loop every appended event goes through: as little as can be
        for type_, _, data, body_json in events:
            version += 1
            pos += 1
            h = hasher(prev, version, type_, body_json, data)
            # The body as a reader of the log will see it (lists, not
            # tuples; null for non-finite floats): live == replay.
            ev = new_event(Event, (pos, sid, version, type_, loads(body_json), data, now, h, prev))
            out.append(ev)
            if data is None:
                rows.append((pos, sid, version, type_, body_json, now, h, prev))
            else:
                self._row(plan, ev, body_json, now, inline_max)
            prev = h
        return out

    def apply(self, cur: Any, plan: Plan, *, expect_position: bool) -> list[list[Event]]:
        """A plan's statements, inside the write transaction.

        ``expect_position``: the plan was made before the transaction; it holds
        only if the log still ends where the plan assumed (else :class:`Moved`).
        """
        if expect_position:
            self.dialect.lock_positions(cur)
            cur.execute("SELECT COALESCE(MAX(position), 0) FROM events")
            if int(cur.fetchone()[0]) != plan.start:
                raise Moved
        for sid in plan.purged:
            cur.execute(self.dialect.sql("DELETE FROM events WHERE session_id = ?"), (sid,))
            cur.execute(self.dialect.sql("DELETE FROM snapshots WHERE session_id = ?"), (sid,))
        if plan.blob_rows:
            self._put_blobs(cur, list(plan.blob_rows.values()))
        if plan.new_sessions:
            cols = [c.name for c in sessions.columns]
            cur.executemany(
                self.dialect.sql(
                    f"INSERT INTO sessions ({', '.join(cols)}) VALUES ({', '.join('?' * len(cols))})"
                ),
                [tuple(row[c] for c in cols) for row in plan.new_sessions.values()],
            )
        if plan.rows:
            self.dialect.insert_rows(cur, "events", EVENT_COLUMNS, plan.rows)
        if plan.data_rows:
            self.dialect.insert_rows(cur, "events", EVENT_DATA_COLUMNS, plan.data_rows)
        if plan.updates:
            self._apply_updates(cur, plan.updates)
        if plan.end > plan.start:
            self.dialect.notify(cur, plan.end)
        return plan.results

    @staticmethod
    def _row(plan: Plan, e: Event, body_json: str, now: float, inline_max: int) -> None:
        """Add ``e``'s row to ``plan``: with its data inline, or in the blobs table
        when larger than ``inline_max``."""
        row = (e.position, e.session_id, e.version, e.type, body_json, e.recorded_at, e.hash)
        data, blob_sha = e.data, None
        if data is None:
            plan.rows.append((*row, e.prev_hash))
            return
        if len(data) > inline_max:
            blob_sha = hashlib.sha256(data).hexdigest()
            plan.blob_rows[blob_sha] = {
                "sha256": blob_sha,
                "size": len(data),
                "data": data,
                "created_at": now,
            }
            data = None
        plan.data_rows.append((*row, e.prev_hash, data, blob_sha))

    def _put_blobs(self, cur: Any, rows: list[dict[str, Any]]) -> None:
        shas = [r["sha256"] for r in rows]
        cur.execute(
            self.dialect.sql(
                f"SELECT sha256 FROM blobs WHERE sha256 IN ({', '.join('?' * len(shas))})"
            ),
            shas,
        )
        have = {r[0] for r in cur.fetchall()}
        fresh = [
            (r["sha256"], r["size"], r["data"], r["created_at"])
            for r in rows
            if r["sha256"] not in have
        ]
        if fresh:
            cur.executemany(
                self.dialect.sql(
                    "INSERT INTO blobs (sha256, size, data, created_at) VALUES (?, ?, ?, ?)"
                ),
                fresh,
            )

    def _index(
        self,
        req: Request,
        head: tuple[int, str] | None,
        out: list[Event],
        now: float,
        new_sessions: dict[str, dict[str, Any]],
        updates: dict[str, dict[str, Any]],
    ) -> None:
        """Fold this request into the batch's sessions-table writes (one per session)."""
        sid = req.session_id
        last = out[-1]
        values: dict[str, Any] = {
            "version": last.version,
            "head_hash": last.hash,
            "updated_at": last.recorded_at,
            "last_active_at": now,
        }
        for e in out:
            st = _STATUS_BY_TYPE.get(e.type)
            if st is not None:
                values["status"] = st
        if req.index:
            values.update(
                {
                    k: v
                    for k, v in req.index.items()
                    if k in ("history_length", "status", "last_active_at")
                }
            )
        if req.kind == "import":
            values["last_active_at"] = last.recorded_at
        if head is None and sid not in new_sessions:
            opened = out[0] if out[0].type == T.SESSION_OPENED else None
            if opened is None or opened.version != 1:
                raise InvalidEvent(f"session {sid}: the first event must be session.opened")
            b = body(opened, SessionOpened)
            eng = b.get("engine")
            parent = b.get("parent")
            row: dict[str, Any] = {
                "id": sid,
                "protocol": str(b.get("protocol", "")),
                "status": "open",
                "label": str(b.get("label", "")),
                "engine": "" if not eng else str(eng.get("engine", "")),
                "model_id": "" if not eng else str(eng.get("model_id", "")),
                "parent_id": None if not parent else parent.get("session_id"),
                "parent_version": None if not parent else parent.get("version"),
                "fork_position": None if not parent else parent.get("token_position"),
                "created_at": opened.recorded_at,
                "ttl_s": b.get("ttl_s"),
                "event_count": len(out),
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
        """The touched sessions' index rows, one statement per shape of change (most
        batches have one): only the columns that change are bound, never ``None``."""
        groups: dict[tuple[tuple[str, ...], bool], list[tuple[Any, ...]]] = {}
        for sid, u in updates.items():
            cols = tuple(c for c in UPDATABLE if u.get(c) is not None)
            groups.setdefault((cols, bool(u.get("reset"))), []).append(
                (*(u[c] for c in cols), u["n"], sid)
            )
        for (cols, reset), rows in groups.items():
            sets = [f"{c} = ?" for c in cols]
            sets.append("event_count = ?" if reset else "event_count = event_count + ?")
            sql = f"UPDATE sessions SET {', '.join(sets)} WHERE id = ?"
            cur.executemany(self.dialect.sql(sql), rows)


def batch_args(plan: Plan) -> list[Any] | None:
    """``plan`` as the arguments of :meth:`Dialect.append_batch` (position lock, the
    log's end before and after, the channel, the event columns, the sessions' index
    columns), the event columns with each event's inline data and blob when an event
    carries data (migration 0003's form of the function; 0002's otherwise, two arrays
    fewer to send); None when the plan needs more than event rows and index updates
    (new sessions, new blobs, a purge)."""
    if plan.purged or plan.blob_rows or plan.new_sessions:
        return None
    if any(u.get("reset") for u in plan.updates.values()):
        return None
    from sessiontape.core.log.postgres import PG_CHANNEL, PG_LOCK_KEY

    columns: list[list[Any]] = [list(c) for c in zip(*plan.rows, strict=True)] or [
        [] for _ in EVENT_COLUMNS
    ]
    if plan.data_rows:
        # migration 0003's form of the function: each event's data and blob too
        columns += [[None] * len(plan.rows), [None] * len(plan.rows)]
        for column, more in zip(columns, zip(*plan.data_rows, strict=True), strict=True):
            column.extend(more)
    ids = list(plan.updates)
    ups = [plan.updates[i] for i in ids]
    index = [[u.get(c) for u in ups] for c in UPDATABLE]
    version, head, updated, active, status, history = index
    counts = [u["n"] for u in ups]
    return [
        PG_LOCK_KEY,
        plan.start,
        plan.end,
        PG_CHANNEL,
        *columns,
        ids,
        counts,
        version,
        head,
        updated,
        active,
        status,
        history,
    ]
