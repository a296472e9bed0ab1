"""The log contract: written once, run on every log backend (SQLite file, PostgreSQL).

What any backend must guarantee, beyond the basics of tests/core/log/test_log.py
(which also runs on both): a refused append consumes nothing (no version, no
position); positions are gapless and increasing across sessions and across
processes sharing the database; a subscription from any position delivers
every later event once, in order, catch-up then live, filtered per session;
snapshots answer ``max_version``; a purge leaves a tombstone that verifies and
verifies after export; an NDJSON export re-imports into any backend byte for byte.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from sessiontape.core.errors import ChainBroken, ConcurrencyError, InvalidEvent, SessionNotFound
from sessiontape.core.events import Event, NewEvent
from sessiontape.core.log import EventLog
from sessiontape.core.log.store import verify_chain


def opened() -> NewEvent:
    return NewEvent(
        "session.opened", {"protocol": "test", "engine": {"engine": "x", "vocab_size": 300}}
    )


def tokens(start: int, toks: list[int]) -> NewEvent:
    return NewEvent("tokens.appended", {"start": start, "tokens": toks})


def ndjson(evs: list[Event]) -> str:
    return "".join(json.dumps(e.to_json()) + "\n" for e in evs)


def from_ndjson(text: str) -> list[Event]:
    return [Event.from_json(json.loads(line)) for line in text.splitlines()]


@pytest.fixture
async def log(db_url: str) -> AsyncIterator[EventLog]:
    lg = await EventLog.open(db_url, poll_interval_s=0.05)
    yield lg
    await lg.close()


async def collect(it: AsyncIterator[Event], n: int) -> list[Event]:
    out: list[Event] = []
    async for e in it:
        out.append(e)
        if len(out) == n:
            break
    return out


async def test_a_refused_append_consumes_no_version_and_no_position(log: EventLog) -> None:
    [first] = await log.append("a", 0, [opened()])
    before = await log.get_session("a")
    for stale in (0, 2, 7):
        with pytest.raises(ConcurrencyError):
            await log.append("a", stale, [tokens(0, [1]), tokens(1, [2])])
    assert await log.read("a") == [first]
    assert await log.get_session("a") == before
    assert await log.last_position() == first.position
    # the next accepted append takes the next version and the next position: no hole
    [nxt] = await log.append("b", 0, [opened()])
    [again] = await log.append("a", 1, [tokens(0, [1])])
    assert (nxt.position, again.position, again.version) == (
        first.position + 1,
        first.position + 2,
        2,
    )
    assert again.prev_hash == first.hash


async def test_positions_are_gapless_across_sessions_and_processes(
    log: EventLog, db_url: str
) -> None:
    """Concurrent appenders over many sessions (and, where the backend is shared
    by several processes, over two EventLog instances): every position from 1
    to N exactly once, each session's versions 1..n in position order."""
    logs = [log]
    if log.shared:
        logs.append(await EventLog.open(db_url, poll_interval_s=0.05))
    watcher = log.subscribe(0)
    sessions, appends = 12, 8
    try:

        async def writer(i: int) -> None:
            lg = logs[i % len(logs)]
            sid = f"w{i}"
            await lg.append(sid, 0, [opened()])
            for v in range(1, appends):
                await lg.append(sid, v, [tokens(v - 1, [v])])

        await asyncio.gather(*(writer(i) for i in range(sessions)))
        everything = await log.read_all(0, limit=100_000)
        n = len(everything)
        assert [e.position for e in everything] == list(range(1, n + 1))
        for i in range(sessions):
            mine = [e for e in everything if e.session_id == f"w{i}"]
            assert [e.version for e in mine] == list(range(1, len(mine) + 1))
            verify_chain(mine)
        # a subscriber opened before the race sees the same order, once each
        seen = await asyncio.wait_for(collect(watcher, n), 15)
        assert [e.position for e in seen] == list(range(1, n + 1))
    finally:
        await watcher.aclose()  # type: ignore[attr-defined]
        for extra in logs[1:]:
            await extra.close()


async def test_subscription_from_a_position_per_session_catch_up_then_live(log: EventLog) -> None:
    await log.append("a", 0, [opened(), tokens(0, [1])])
    await log.append("b", 0, [opened()])
    a3 = (await log.append("a", 2, [tokens(1, [2])]))[0]
    mark = a3.position  # resume after a's version 3
    await log.append("b", 1, [tokens(0, [9])])
    await log.append("a", 3, [tokens(2, [3])])  # a's v4: past, after the mark

    only_a = asyncio.create_task(collect(log.subscribe(mark, session_id="a"), 3))
    all_after = asyncio.create_task(collect(log.subscribe(mark), 5))
    await asyncio.sleep(0.1)  # both are caught up and waiting live
    await log.append("b", 2, [tokens(1, [8])])
    await log.append("a", 4, [tokens(3, [4]), tokens(4, [5])])  # live: a's v5, v6

    got_a = await asyncio.wait_for(only_a, 10)
    got_all = await asyncio.wait_for(all_after, 10)
    assert [(e.session_id, e.version) for e in got_a] == [("a", 4), ("a", 5), ("a", 6)]
    assert [(e.session_id, e.version) for e in got_all] == [
        ("b", 2),
        ("a", 4),
        ("b", 3),
        ("a", 5),
        ("a", 6),
    ]
    assert all(e.position > mark for e in got_all)
    assert [e.position for e in got_all] == sorted(e.position for e in got_all)
    # what a subscriber is handed is what a reader reads back
    assert got_all == await log.read_all(mark)


async def test_snapshots_keep_the_latest_and_answer_max_version(log: EventLog) -> None:
    await log.append("s", 0, [opened(), tokens(0, [1]), tokens(1, [2])])
    assert await log.load_snapshot("s") is None
    await log.save_snapshot("s", 2, '{"v": 2}', b"\x00\xff")
    assert await log.load_snapshot("s") == (2, '{"v": 2}', b"\x00\xff")
    assert await log.load_snapshot("s", max_version=2) == (2, '{"v": 2}', b"\x00\xff")
    assert (
        await log.load_snapshot("s", max_version=1) is None
    )  # a replay to v1 must fold from scratch
    await log.save_snapshot("s", 3, '{"v": 3}', None)
    assert await log.load_snapshot("s") == (3, '{"v": 3}', None)
    assert await log.load_snapshot("other") is None


async def test_purge_leaves_a_tombstone_that_verifies_alone(log: EventLog) -> None:
    await log.append("keep", 0, [opened()])
    evs = await log.append(
        "gone", 0, [opened(), tokens(0, [1, 2]), NewEvent("note.recorded", {}, b"x" * 5000)]
    )
    await log.append("keep", 1, [tokens(0, [3])])
    tomb = await log.purge("gone", reason="retention")
    assert (
        tomb.type == "session.purged"
        and tomb.version == len(evs) + 1
        and tomb.prev_hash == evs[-1].hash
    )
    rest = await log.read("gone")
    assert rest == [tomb]
    verify_chain(rest)
    assert [e.version for e in await log.read("keep")] == [1, 2]  # other sessions untouched
    assert [e.session_id for e in await collect(log.subscribe(0, session_id="gone"), 1)] == ["gone"]
    # a forged tombstone (body edited) is caught
    bad = Event.from_json({**tomb.to_json(), "body": {**tomb.body, "through_version": 1}})
    with pytest.raises(ChainBroken):
        verify_chain([bad])
    # the tombstone alone is what an export of the session holds, and it verifies after the trip
    verify_chain(from_ndjson(ndjson(rest)))
    # ... but there is nothing left to import: a clear refusal, nothing written
    with pytest.raises(InvalidEvent, match="purged"):
        await log.import_events(
            from_ndjson(ndjson([Event.from_json({**tomb.to_json(), "session_id": "gone"})]))
        )
    assert await log.read("gone") == [tomb]


async def test_ndjson_export_reimports_identically_both_ways(log: EventLog, tmp_path: Path) -> None:
    """Export from this backend into a fresh SQLite file, and from a SQLite file
    into this backend: the same events, hashes and payloads (blobs included);
    only the positions are the target's own."""
    big = bytes(range(256)) * 40  # above the inline limit: a content-addressed blob

    def body(sid: str) -> list[NewEvent]:
        return [
            opened(),
            tokens(0, [1, 2, 3]),
            NewEvent("note.recorded", {"k": "é", "sid": sid}, big),
            NewEvent("feedback.recorded", {"score": 1.5, "comment": None}),
        ]

    def unplaced(evs: list[Event]) -> list[dict[str, object]]:
        return [{k: v for k, v in e.to_json().items() if k != "position"} for e in evs]

    scratch = await EventLog.open(f"sqlite+aiosqlite:///{tmp_path / 'scratch.db'}")
    try:
        for src, dst, sid in ((log, scratch, "out"), (scratch, log, "in")):
            written = await src.append(sid, 0, body(sid))
            text = ndjson(await src.read(sid))
            assert text == ndjson(written)
            imported = await dst.import_events(from_ndjson(text), index={"history_length": 3})
            back = await dst.read(sid)
            assert imported == back
            assert unplaced(back) == unplaced(written)
            assert back[2].data == big
            verify_chain(back)
            row = await dst.get_session(sid)
            assert (row.version, row.head_hash, row.history_length) == (4, written[-1].hash, 3)
            with pytest.raises(ConcurrencyError):  # the session exists there now
                await dst.import_events(back)
            tampered = Event.from_json(
                {**written[1].to_json(), "body": {"start": 0, "tokens": [7]}}
            )
            with pytest.raises(ChainBroken):  # checked before anything is written
                await dst.import_events([written[0], tampered, *written[2:]])
            assert await dst.read(sid) == back
    finally:
        await scratch.close()


async def test_the_sessions_index_reads_filter_order_and_page(log: EventLog) -> None:
    """get_session, list_sessions and idle_sessions answer from the index on every
    backend: each filter, both orders, a page, an unknown id, the idle TTL."""

    def opened_as(protocol: str, ttl_s: float | None, parent: str | None = None) -> NewEvent:
        body: dict[str, object] = {
            "protocol": protocol,
            "label": f"{protocol} session",
            "engine": {"engine": "x", "model_id": "m", "vocab_size": 300},
            "ttl_s": ttl_s,
        }
        if parent is not None:
            body["parent"] = {"session_id": parent, "version": 2, "token_position": 1}
        return NewEvent("session.opened", body)

    await log.append("a", 0, [opened_as("http", 60.0), tokens(0, [1, 2])])
    await asyncio.sleep(0.01)  # created_at orders the list
    await log.append("b", 0, [opened_as("grpc", None, parent="a")])
    await asyncio.sleep(0.01)
    await log.append("c", 0, [opened_as("http", 0.001)])
    row = await log.get_session("b")
    assert (row.id, row.protocol, row.status, row.label, row.engine, row.model_id) == (
        "b",
        "grpc",
        "open",
        "grpc session",
        "x",
        "m",
    )
    assert (row.parent_id, row.parent_version, row.fork_position) == ("a", 2, 1)
    assert (row.version, row.event_count, row.ttl_s) == (1, 1, None)
    a = await log.get_session("a")
    assert (a.version, a.event_count, a.ttl_s, a.parent_id) == (2, 2, 60.0, None)
    assert isinstance(a.created_at, float) and a.created_at <= row.created_at
    with pytest.raises(SessionNotFound):
        await log.get_session("nope")

    async def ids(**kw: Any) -> list[str]:
        return [r.id for r in await log.list_sessions(**kw)]

    assert await ids() == ["c", "b", "a"]
    assert await ids(newest_first=False) == ["a", "b", "c"]
    assert await ids(limit=1, offset=1) == ["b"]
    assert await ids(protocol="http") == ["c", "a"]
    assert await ids(parent_id="a") == ["b"]
    assert await ids(status="open", protocol="grpc") == ["b"]
    assert await ids(status="closed") == []
    assert await ids(active_after=row.last_active_at) == ["c"]
    # a TTL of its own, or the default for one without; open sessions only
    now = (await log.get_session("c")).last_active_at + 1.0
    assert sorted(r.id for r in await log.idle_sessions(now, 30.0)) == ["c"]
    assert sorted(r.id for r in await log.idle_sessions(now + 60.0, 30.0)) == ["a", "b", "c"]
