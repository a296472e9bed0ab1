"""The event log contract, run against SQLite and PostgreSQL alike."""

from __future__ import annotations

import asyncio

import pytest

from sessiontape.core.bodies import fork_point
from sessiontape.core.errors import ChainBroken, ConcurrencyError
from sessiontape.core.events import GENESIS_HASH, Event, NewEvent, T
from sessiontape.core.log import EventLog
from sessiontape.core.log.store import verify_chain
from tests.helpers.events import appended, opened


@pytest.fixture
async def log(db_url: str):  # type: ignore[no-untyped-def]
    lg = await EventLog.open(db_url)
    yield lg
    await lg.close()


async def test_append_read_chain(log: EventLog) -> None:
    evs = await log.append("s1", 0, [opened(), appended(0, [1, 2, 3])])
    assert [e.version for e in evs] == [1, 2]
    assert evs[0].prev_hash == GENESIS_HASH and evs[1].prev_hash == evs[0].hash
    more = await log.append("s1", 2, [appended(3, [4])], index={"history_length": 4})
    back = await log.read("s1")
    assert back == evs + more
    verify_chain(back)
    row = await log.get_session("s1")
    assert (row.version, row.event_count, row.history_length, row.status) == (3, 3, 4, "open")
    assert row.head_hash == more[-1].hash


async def test_one_commit_updates_every_session_it_touches_with_its_own_changes(
    log: EventLog,
) -> None:
    # A batch touching many sessions writes their index rows grouped by which columns
    # change (only those are bound); each row gets exactly its own changes.
    n = 40
    sids = [f"u{i}" for i in range(n)]
    await asyncio.gather(*(log.append(s, 0, [opened()]) for s in sids))
    for s in sids[:3]:
        await log.append(s, 1, [appended(0, [1])])
        await log.purge(s)

    def change(i: int) -> tuple[list[NewEvent], dict[str, int] | None]:
        evs = [appended(0, list(range(1 + i % 5)))] * (1 + i % 3)
        if i % 7 == 0:
            evs = [*evs, NewEvent(T.SESSION_CLOSED, {"reason": "done"})]
        return evs, ({"history_length": 100 + i} if i % 2 else None)

    heads = {s: (await log.get_session(s)).version for s in sids}
    counts = {s: (await log.get_session(s)).event_count for s in sids}
    outs = await asyncio.gather(
        *(log.append(s, heads[s], change(i)[0], index=change(i)[1]) for i, s in enumerate(sids))
    )
    for i, (s, out) in enumerate(zip(sids, outs, strict=True)):
        row = await log.get_session(s)
        evs, index = change(i)
        assert row.version == heads[s] + len(evs) == out[-1].version
        assert row.head_hash == out[-1].hash
        assert row.event_count == counts[s] + len(evs)
        assert row.status == ("closed" if i % 7 == 0 else "purged" if i < 3 else "open")
        assert row.history_length == (100 + i if index else 0)
        verify_chain(await log.read(s))


async def test_stale_expected_version_writes_nothing(log: EventLog) -> None:
    await log.append("s1", 0, [opened()])
    with pytest.raises(ConcurrencyError):
        await log.append("s1", 0, [appended(0, [1])])
    with pytest.raises(ConcurrencyError):
        await log.append("s1", 5, [appended(0, [1])])
    assert [e.version for e in await log.read("s1")] == [1]
    assert (await log.get_session("s1")).version == 1


async def test_racing_appenders_one_wins(log: EventLog) -> None:
    await log.append("s1", 0, [opened()])
    results = await asyncio.gather(
        *(log.append("s1", 1, [appended(0, [i])]) for i in range(5)), return_exceptions=True
    )
    wins = [r for r in results if not isinstance(r, BaseException)]
    losses = [r for r in results if isinstance(r, ConcurrencyError)]
    assert len(wins) == 1 and len(losses) == 4
    assert [e.version for e in await log.read("s1")] == [1, 2]


async def test_group_commit_many_sessions_positions_gapless(log: EventLog) -> None:
    async def writer(i: int) -> None:
        sid = f"w{i}"
        await log.append(sid, 0, [opened()])
        for v in range(1, 20):
            await log.append(sid, v, [appended(v - 1, [v])])

    await asyncio.gather(*(writer(i) for i in range(20)))
    allev = await log.read_all(0, limit=10_000)
    assert [e.position for e in allev] == list(range(1, 401))
    for i in range(20):
        evs = await log.read(f"w{i}")
        assert [e.version for e in evs] == list(range(1, 21))
        verify_chain(evs)


async def test_subscribe_catch_up_then_live_no_gap_no_dup(log: EventLog) -> None:
    await log.append("s1", 0, [opened(), appended(0, [1])])
    got: list[int] = []

    async def consume() -> None:
        async for e in log.subscribe(from_position=1):
            got.append(e.position)
            if len(got) == 21:
                return

    task = asyncio.create_task(consume())
    for v in range(2, 22):
        await log.append("s1", v, [appended(v - 1, [v])])
    await asyncio.wait_for(task, 10)
    assert got == list(range(2, 23))


async def test_subscribe_batches_hands_a_committed_run_over_together(log: EventLog) -> None:
    await log.append("s1", 0, [opened()])
    got: list[list[int]] = []
    started = asyncio.Event()

    async def consume() -> None:
        started.set()
        async for batch in log.subscribe_batches(from_position=1, session_id="s1"):
            got.append([e.version for e in batch])
            if batch[-1].version == 8:
                return

    task = asyncio.create_task(consume())
    await started.wait()
    await asyncio.sleep(0.05)  # the subscriber is live, waiting
    await log.append("s1", 1, [appended(k, [k]) for k in range(5)])
    await log.append("s1", 6, [appended(5, [5]), appended(6, [6])])
    await asyncio.wait_for(task, 10)
    if log.subscriptions.tail:
        # a tailer (PostgreSQL) reads what is committed when it wakes: both
        # commits may come in one read, but a commit is never split
        assert got in ([[2, 3, 4, 5, 6], [7, 8]], [[2, 3, 4, 5, 6, 7, 8]])
    else:
        assert got == [[2, 3, 4, 5, 6], [7, 8]]


async def test_a_subscriber_that_falls_behind_catches_up_without_gaps(
    log: EventLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past its queue's bound a subscriber reads the rest from the database: every
    event once, in order, whether it reads one by one or in batches."""
    from sessiontape.core.log import subscriptions

    monkeypatch.setattr(subscriptions._Subscriber, "QUEUE_MAX", 8)
    await log.append("s1", 0, [opened()])
    one: list[int] = []
    batched: list[int] = []
    first = asyncio.Event()
    go_on = asyncio.Event()

    async def by_event() -> None:
        async for e in log.subscribe(from_position=1, session_id="s1"):
            one.append(e.version)
            if len(one) == 1:
                first.set()
                await go_on.wait()  # the writer overflows this subscriber's queue meanwhile
            if e.version == 101:
                return

    async def by_batch() -> None:
        async for batch in log.subscribe_batches(from_position=1, session_id="s1"):
            batched.extend(e.version for e in batch)
            await go_on.wait()
            if batched[-1] == 101:
                return

    tasks = [asyncio.create_task(by_event()), asyncio.create_task(by_batch())]
    await asyncio.sleep(0.05)
    await log.append("s1", 1, [appended(0, [0])])
    await asyncio.wait_for(first.wait(), 10)
    for v in range(2, 101, 3):
        await log.append("s1", v, [appended(v - 1 + k, [k]) for k in range(3)])
    go_on.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 20)
    assert one == batched == list(range(2, 102))


async def test_subscription_sees_nothing_before_commit(log: EventLog) -> None:
    await log.append("s1", 0, [opened()])
    seen: list[int] = []
    gate = asyncio.Event()
    committing = asyncio.Event()

    async def hold(_evs: object) -> None:
        committing.set()
        await gate.wait()

    async def consume() -> None:
        async for e in log.subscribe(from_position=1, session_id="s1"):
            seen.append(e.version)
            return

    sub = asyncio.create_task(consume())
    log.before_commit = hold
    app = asyncio.create_task(log.append("s1", 1, [appended(0, [7])]))
    await asyncio.wait_for(committing.wait(), 5)
    await asyncio.sleep(0.2)
    assert seen == [] and not app.done()
    log.before_commit = None
    gate.set()
    await asyncio.wait_for(app, 5)
    await asyncio.wait_for(sub, 5)
    assert seen == [2]


async def test_large_payloads_are_content_addressed_blobs(log: EventLog) -> None:
    payload = bytes(range(256)) * 64  # 16 KiB, above the inline limit
    await log.append("a", 0, [opened(), NewEvent(T.NOTE, {"k": 1}, payload)])
    await log.append("b", 0, [opened(), NewEvent(T.NOTE, {"k": 2}, payload)])
    [ea] = (await log.read("a"))[1:]
    [eb] = (await log.read("b"))[1:]
    assert ea.data == payload and eb.data == payload
    import hashlib

    assert await log.get_blob(hashlib.sha256(payload).hexdigest()) == payload
    [(blobs,)] = await log.dialect.fetch("SELECT COUNT(*) FROM blobs", ())
    assert blobs == 1


@pytest.mark.parametrize("repeat", [1, 8])  # 8: enough rows of each kind for PostgreSQL's COPY
async def test_events_with_and_without_data_interleaved_in_one_commit_read_back_in_order(
    log: EventLog, repeat: int
) -> None:
    # Rows with data and rows without are written by different statements of one
    # transaction; positions, data (none, empty, inline, blob) and the chain survive.
    big = bytes(range(256)) * 64
    kinds: list[bytes | None] = [
        None,
        b"",
        b"\x00inline",
        big,
        None,
        b"x",
        big + b"!",
        None,
    ] * repeat
    await log.append("m", 0, [opened()])
    await log.append("n", 0, [opened()])
    batches = [
        log.append(sid, 1, [NewEvent(T.NOTE, {"i": i, "sid": sid}, d) for i, d in enumerate(kinds)])
        for sid in ("m", "n")
    ]
    outs = await asyncio.gather(*batches)  # queued together: one commit, as a rule
    for sid, out in zip(("m", "n"), outs, strict=True):
        back = await log.read(sid)
        assert back[1:] == out
        assert [e.data for e in back[1:]] == kinds
        assert [e.body["i"] for e in back[1:]] == list(range(len(kinds)))
        verify_chain(back)
    everything = await log.read_all()
    positions = [e.position for e in everything]
    assert (
        positions
        == sorted(positions)
        == list(range(positions[0], positions[0] + 2 + 2 * len(kinds)))
    )


async def test_purge_leaves_a_verifiable_tombstone(log: EventLog) -> None:
    evs = await log.append("s1", 0, [opened(), appended(0, [1, 2])])
    tomb = await log.purge("s1")
    rest = await log.read("s1")
    assert rest == [tomb]
    assert tomb.version == 3 and tomb.prev_hash == evs[-1].hash
    assert tomb.body["through_version"] == 2
    verify_chain(rest)
    row = await log.get_session("s1")
    assert row.status == "purged" and row.event_count == 1


async def test_import_roundtrip_is_exact_and_rejects_broken_chains(log: EventLog, tmp_path) -> None:  # type: ignore[no-untyped-def]
    evs = await log.append(
        "s1", 0, [opened(), appended(0, [1, 2]), NewEvent(T.NOTE, {}, b"\x00\x01")]
    )
    other = await EventLog.open(f"sqlite+aiosqlite:///{tmp_path / 'other.db'}")
    try:
        tampered = [evs[0], evs[1]._replace(body={"start": 0, "tokens": [9]}), evs[2]]
        with pytest.raises(ChainBroken):
            await other.import_events(tampered)
        assert await other.read("s1") == []
        back = await other.import_events(evs)
        assert [
            (e.version, e.type, e.body, e.data, e.recorded_at, e.hash, e.prev_hash) for e in back
        ] == [(e.version, e.type, e.body, e.data, e.recorded_at, e.hash, e.prev_hash) for e in evs]
        assert [e.to_json() for e in await other.read("s1")] == [e.to_json() for e in back]
        with pytest.raises(ConcurrencyError):
            await other.import_events(evs)
    finally:
        await other.close()


async def test_snapshots_roundtrip(log: EventLog) -> None:
    await log.append("s1", 0, [opened()])
    await log.save_snapshot("s1", 1, '{"x": 1}', b"\x01\x02")
    await log.save_snapshot("s1", 1, '{"x": 2}', None)
    assert await log.load_snapshot("s1") == (1, '{"x": 2}', None)
    assert await log.load_snapshot("nope") is None


async def test_follower_sees_another_process_on_sqlite(sqlite_url: str) -> None:
    writer = await EventLog.open(sqlite_url)
    follower = await EventLog.open(sqlite_url, follow=True, poll_interval_s=0.05)
    try:
        await writer.append("s1", 0, [opened()])
        got: list[int] = []

        async def follow() -> None:
            async for e in follower.subscribe(0, session_id="s1"):
                got.append(e.version)
                if len(got) == 4:
                    return

        task = asyncio.create_task(follow())
        for v in range(1, 4):
            await writer.append("s1", v, [appended(v - 1, [v])])
        await asyncio.wait_for(task, 10)
        assert got == [1, 2, 3, 4]
    finally:
        await follower.close()
        await writer.close()


def test_the_append_hasher_is_the_chain_hash() -> None:
    """The writer's per-append hasher (shared parts encoded once) computes exactly
    chain_hash_json, for every kind of body, payload and time."""
    from sessiontape.core.events import canonical_json, chain_hash_json, chain_hasher

    cases = [
        ({"a": 1, "t": "é\u2028"}, None),
        ({}, b""),
        ({"x": [1.5, -0.0, 1e-300]}, b"\x00" * 5000),
    ]
    for recorded_at in (0.0, 1763880000.123456, 1e-7):
        h = chain_hasher("s_\u00fc", recorded_at)
        for v, (body, data) in enumerate(cases, 1):
            bj = canonical_json(body)
            assert h("0" * 64, v, "note.recorded", bj, data) == chain_hash_json(
                "0" * 64, "s_\u00fc", v, "note.recorded", bj, data, recorded_at
            )


async def test_a_session_subscription_with_forks_sees_its_events_and_its_forks_only(
    log: EventLog,
) -> None:
    """Catch-up and live alike: the session's own events and the opening of each
    fork of it; another session's events, and the rest of a fork's, never."""

    def fork_of(parent: str) -> NewEvent:
        return NewEvent(
            T.SESSION_OPENED,
            {"protocol": "test", "parent": {"session_id": parent, "version": 1}},
        )

    await log.append("a", 0, [opened()])
    await log.append("b", 0, [opened(), appended(0, [1])])
    await log.append("a-fork-1", 0, [fork_of("a"), appended(0, [2])])
    await log.append("b-fork", 0, [fork_of("b")])
    got: list[tuple[str, int]] = []
    done = asyncio.Event()

    async def watch() -> None:
        async for e in log.subscribe(0, "a", with_forks=True):
            got.append((e.session_id, e.version))
            if len(got) == 5:
                done.set()
                return

    task = asyncio.create_task(watch())
    await asyncio.sleep(0.05)  # caught up: now live
    await log.append("b", 2, [appended(1, [3])])
    await log.append("a", 1, [appended(0, [4])])
    await log.append("a-fork-2", 0, [fork_of("a")])
    await log.append("a-fork-1", 2, [appended(1, [5])])
    await log.append("a", 2, [appended(1, [6])])
    await asyncio.wait_for(done.wait(), 10)
    await task
    assert got == [("a", 1), ("a-fork-1", 1), ("a", 2), ("a-fork-2", 1), ("a", 3)]


async def test_a_lock_held_by_another_sqlite_connection_never_blocks_the_event_loop(
    sqlite_url: str,
) -> None:
    """A lone append is tried inline without waiting for the write lock; when another
    connection holds it, the append waits on the writer thread while the loop runs on,
    and later inline tries still do not wait (the busy timeout follows the mode)."""
    import sqlite3
    import time

    path = sqlite_url.split("///", 1)[1]
    lg = await EventLog.open(sqlite_url)
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        await lg.append("s1", 0, [opened()])  # inline: nobody holds the lock
        for version in (1, 2):
            other.execute("BEGIN IMMEDIATE")
            ticks = 0
            longest = 0.0

            async def ticker() -> None:
                nonlocal ticks, longest
                last = time.perf_counter()
                while True:
                    await asyncio.sleep(0.01)
                    now = time.perf_counter()
                    ticks, longest = ticks + 1, max(longest, now - last)
                    last = now

            tick = asyncio.create_task(ticker())
            append = asyncio.create_task(lg.append("s1", version, [appended(0, [version])]))
            await asyncio.sleep(0.4)
            assert not append.done()  # waiting for the lock, on the writer thread
            other.execute("COMMIT")
            evs = await asyncio.wait_for(append, 10)
            tick.cancel()
            assert [e.version for e in evs] == [version + 1]
            assert ticks >= 20 and longest < 0.2  # the loop ran on throughout
        # inline again once the lock is free
        assert [e.version for e in await lg.append("s1", 3, [appended(0, [9])])] == [4]
    finally:
        other.close()
        await lg.close()


async def test_each_subscriber_gets_a_commit_as_a_list_of_its_own(log: EventLog) -> None:
    """A commit reaches every live subscriber at once, as one batch each: a reader
    that keeps or changes the list it was given does not change another's."""
    await log.append("a", 0, [opened()])
    first = log.subscribe_batches(1)
    second = log.subscribe_batches(1)
    one = asyncio.ensure_future(anext(first))
    two = asyncio.ensure_future(anext(second))
    await asyncio.sleep(0.05)
    evs = await log.append("a", 1, [appended(k, [k]) for k in range(5)])
    got_one = await asyncio.wait_for(one, 5)
    got_one.clear()
    assert await asyncio.wait_for(two, 5) == evs
    await first.aclose()  # type: ignore[attr-defined]
    await second.aclose()  # type: ignore[attr-defined]


async def test_what_commits_while_a_subscriber_catches_up_still_reaches_it(
    log: EventLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A subscriber that fell behind reads the rest from the database; an event that
    commits after that read saw the log, and before the subscriber is live again,
    comes through its queue: no gap."""
    from sessiontape.core.log import subscriptions

    monkeypatch.setattr(subscriptions._Subscriber, "QUEUE_MAX", 4)
    await log.append("s", 0, [opened()])
    read = log.subscriptions._read
    reading, go_on = asyncio.Event(), asyncio.Event()
    holding: list[bool] = []

    async def slow_read(after: int, limit: int, sid: str | None) -> list[Event]:
        evs = await read(after, limit, sid)
        if holding:  # the catch-up after the overflow: what the log held then
            holding.clear()
            reading.set()
            await go_on.wait()
        return evs

    log.subscriptions._read = slow_read  # type: ignore[method-assign]
    got: list[int] = []
    first, release = asyncio.Event(), asyncio.Event()

    async def watch() -> None:
        async for e in log.subscribe(from_position=1, session_id="s"):
            got.append(e.version)
            if len(got) == 1:
                first.set()
                await release.wait()  # fall behind while more commits
            if e.version == 12:
                return

    task = asyncio.create_task(watch())
    await asyncio.sleep(0.05)
    await log.append("s", 1, [appended(0, [0])])
    await asyncio.wait_for(first.wait(), 5)
    for v in range(2, 10):  # past the queue's bound of 4
        await log.append("s", v, [appended(v - 1, [v])])
    holding.append(True)
    release.set()
    await asyncio.wait_for(reading.wait(), 5)
    for v in range(10, 13):  # after the catch-up's read, before it is live again
        await log.append("s", v, [appended(v - 1, [v])])
    go_on.set()
    await asyncio.wait_for(task, 10)
    assert got == list(range(2, 13))


async def test_a_commit_larger_than_a_live_subscribers_bound_is_read_back(
    log: EventLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One commit past the queue's bound is dropped from the queue, not from the
    subscriber: it is read from the database before anything after it is handed out."""
    from sessiontape.core.log import subscriptions

    monkeypatch.setattr(subscriptions._Subscriber, "QUEUE_MAX", 4)
    await log.append("s", 0, [opened()])
    got: list[int] = []

    async def watch() -> None:
        async for e in log.subscribe(from_position=1, session_id="s"):
            got.append(e.version)
            if e.version == 8:
                return

    task = asyncio.create_task(watch())
    await asyncio.sleep(0.05)  # live, waiting on its queue
    await log.append("s", 1, [appended(k, [k]) for k in range(5)])
    await log.append("s", 6, [appended(5, [5])])
    await asyncio.sleep(0.05)
    await log.append("s", 7, [appended(6, [6])])
    await asyncio.wait_for(task, 10)
    assert got == list(range(2, 9))


async def test_a_tailing_log_closes_when_a_wake_up_lands_as_it_closes(sqlite_url: str) -> None:
    """A tailer woken (another replica's NOTIFY, or its poll timer) in the very turn
    the log closes still stops: Python 3.11's wait_for returned the wake-up and lost
    the cancel, and close() waited for the tailer forever (a replica that hung on
    shutdown while the others wrote)."""
    writer = await EventLog.open(sqlite_url)
    try:
        for _ in range(10):
            follower = await EventLog.open(sqlite_url, follow=True, poll_interval_s=30.0)
            await asyncio.sleep(0.002)  # the tailer waits for a wake-up
            # the wake-up and the cancel in one turn (EventLog.close awaits the
            # writer first, where a NOTIFY can land just so)
            follower.subscriptions.wake()
            closing = asyncio.ensure_future(follower.subscriptions.close())
            try:
                done, _ = await asyncio.wait({closing}, timeout=3)
                assert done, "the tailer did not stop"
            finally:
                closing.cancel()  # (a second cancel stops the tailer of a failed run)
                await follower.close()
        # and a follower still follows: its tailer reads what another process commits
        follower = await EventLog.open(sqlite_url, follow=True, poll_interval_s=0.01)
        try:
            got: list[int] = []

            async def follow() -> None:
                async for e in follower.subscribe(0, session_id="s2"):
                    got.append(e.version)
                    return

            task = asyncio.create_task(follow())
            await writer.append("s2", 0, [opened()])
            await asyncio.wait_for(task, 10)
            assert got == [1]
        finally:
            await follower.close()
    finally:
        await writer.close()


async def test_live_subscribers_of_many_sessions_each_get_theirs_once_in_order(
    log: EventLog,
) -> None:
    """Commits of several sessions at once (a parent's events and its fork's opening
    among them) reach each live subscriber exactly as ``wants`` says: every event of
    the log, one session's, or one session's plus its forks' openings; once each, in
    position order, and nothing for a session nobody touched."""

    def fork_of(parent: str) -> NewEvent:
        return NewEvent(
            T.SESSION_OPENED,
            {"protocol": "test", "parent": {"session_id": parent, "version": 1}},
        )

    for sid in ("a", "b", "idle"):
        await log.append(sid, 0, [opened()])
    start = await log.last_position()
    kinds = {
        "all": (None, False),
        "a": ("a", False),
        "a+forks": ("a", True),
        "b+forks": ("b", True),
        "idle": ("idle", False),
    }
    streams = {k: log.subscribe_batches(start, sid, with_forks=f) for k, (sid, f) in kinds.items()}
    got: dict[str, list[Event]] = {k: [] for k in kinds}

    async def read(k: str) -> None:
        async for batch in streams[k]:
            got[k].extend(batch)

    tasks = [asyncio.create_task(read(k)) for k in kinds]
    await asyncio.sleep(0.05)  # caught up: now live
    # the first append of a burst commits on its own (the writer was idle); the
    # rest share commits: a parent's events with its fork's opening among them
    await asyncio.gather(
        log.append("c", 0, [opened()]),
        log.append("a", 1, [appended(0, [0])]),
        log.append("a-fork", 0, [fork_of("a"), appended(0, [9])]),
        log.append("b", 1, [appended(0, [1]), appended(1, [2])]),
        log.append("b-fork", 0, [fork_of("b")]),
    )
    await asyncio.gather(
        log.append("c", 1, [appended(0, [7])]),
        log.append("a", 2, [appended(1, [3])]),
        log.append("a-fork-2", 0, [fork_of("a")]),
    )
    await log.append("a-fork-3", 0, [fork_of("a")])  # a fork's opening alone in its commit
    everything = await log.read_all(start, 1000)
    assert len(everything) == 11

    def wanted(sid: str | None, forks: bool) -> list[Event]:
        if sid is None:
            return everything
        return [
            e
            for e in everything
            if e.session_id == sid or (forks and (fork_point(e) or {}).get("session_id") == sid)
        ]

    for _ in range(200):
        if all(len(got[k]) == len(wanted(*kinds[k])) for k in kinds):
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # nothing more arrives
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for k, (sid, forks) in kinds.items():
        assert got[k] == wanted(sid, forks), k
    assert got["idle"] == [] and [e.session_id for e in got["a+forks"]].count("a-fork") == 1
