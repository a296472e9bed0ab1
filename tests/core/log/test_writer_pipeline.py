"""The writer's pipeline: batches planned ahead of their transaction, multi-row
inserts, and what happens when a plan no longer holds.

Run against SQLite and PostgreSQL alike (PostgreSQL plans inside the
transaction; the results must be the same).
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from typing import Any

import pytest

from sessiontape.core.errors import ConcurrencyError, InvalidValue
from sessiontape.core.events import NewEvent, T, canonical_json
from sessiontape.core.log import EventLog
from sessiontape.core.log.store import verify_chain
from sessiontape.core.log.writer import NOW_IDLE_S
from tests.helpers.events import appended, opened


@pytest.fixture
async def log(db_url: str):  # type: ignore[no-untyped-def]
    lg = await EventLog.open(db_url)
    yield lg
    await lg.close()


@pytest.mark.parametrize("n", [1, 2, 3, 511, 1023, 1024, 1025, 3001])
async def test_every_batch_size_is_written_whole_and_in_order(log: EventLog, n: int) -> None:
    await log.append("s", 0, [opened()])
    evs = await log.append("s", 1, [appended(i, [i % 250]) for i in range(n)])
    back = await log.read("s")
    assert back[1:] == evs
    assert [e.version for e in back] == list(range(1, n + 2))
    assert [e.position for e in back] == list(range(1, n + 2))
    assert [e.body["start"] for e in back[1:]] == list(range(n))
    verify_chain(back)


async def test_planned_batches_stay_gapless_while_many_sessions_append(log: EventLog) -> None:
    """Enough appenders that batches queue up behind each other, so each is
    planned while the one before it commits."""

    async def writer(i: int) -> None:
        sid = f"w{i}"
        await log.append(sid, 0, [opened()])
        for v in range(1, 30, 3):
            await log.append(sid, v, [appended(v - 1 + k, [k]) for k in range(3)])

    await asyncio.gather(*(writer(i) for i in range(40)))
    allev = await log.read_all(0, limit=100_000)
    assert [e.position for e in allev] == list(range(1, 40 * 31 + 1))
    for i in range(40):
        evs = await log.read(f"w{i}")
        assert [e.version for e in evs] == list(range(1, 32))
        verify_chain(evs)
        row = await log.get_session(f"w{i}")
        assert (row.version, row.event_count, row.head_hash) == (31, 31, evs[-1].hash)


async def test_a_failed_request_does_not_break_the_batches_planned_after_it(
    log: EventLog,
) -> None:
    """A conflict inside one batch makes the writer retry its requests one by one;
    the batch planned behind it assumed the first would commit whole, so it
    must be planned again: every good append lands once, at the right version."""
    sids = [f"c{i}" for i in range(30)]
    for sid in sids:
        await log.append(sid, 0, [opened()])

    async def good(sid: str) -> None:
        for v in range(1, 11):
            await log.append(sid, v, [appended(v - 1, [v])])

    async def bad(sid: str) -> list[BaseException | list[object]]:
        # stale versions, refused every time, interleaved with the good appends
        return await asyncio.gather(
            *(log.append(sid, 0, [appended(0, [9])]) for _ in range(10)),
            return_exceptions=True,
        )

    results = await asyncio.gather(*(good(s) for s in sids), bad(sids[0]), bad(sids[7]))
    for refused in results[-2:]:
        assert refused and all(isinstance(r, ConcurrencyError) for r in refused)
    for sid in sids:
        evs = await log.read(sid)
        assert [e.version for e in evs] == list(range(1, 12))
        assert [e.body["tokens"] for e in evs[1:]] == [[v] for v in range(1, 11)]
        verify_chain(evs)
    allev = await log.read_all(0, limit=100_000)
    assert [e.position for e in allev] == list(range(1, len(allev) + 1))


async def test_another_writer_in_between_is_noticed(sqlite_url: str) -> None:
    """A second process writing the same SQLite file (here: a second log) moves
    the end of the log after this writer planned from its cache: the writer
    notices under the write lock and plans again, so positions stay gapless
    and unique."""
    first = await EventLog.open(sqlite_url)
    second = await EventLog.open(sqlite_url)
    try:
        await first.append("a", 0, [opened()])
        await first.append("a", 1, [appended(0, [1])])  # the writer now plans from its cache
        await second.append("b", 0, [opened(), appended(0, [5])])
        evs = await first.append("a", 2, [appended(1, [2]), appended(2, [3])])
        assert [e.position for e in evs] == [5, 6]
        allev = await first.read_all(0, limit=100)
        assert [(e.session_id, e.position) for e in allev] == [
            ("a", 1),
            ("a", 2),
            ("b", 3),
            ("b", 4),
            ("a", 5),
            ("a", 6),
        ]
        verify_chain(await first.read("a"))
    finally:
        await second.close()
        await first.close()


async def test_the_stored_body_is_the_body_when_the_event_was_made(log: EventLog) -> None:
    """A NewEvent encodes its body once, when made (and refuses what cannot be
    stored then): changing the dict afterwards changes neither what is stored
    nor what is hashed, and the committed event shows what was stored."""
    body: dict[str, object] = {"start": 0, "tokens": [1]}
    ne = NewEvent(T.TOKENS_APPENDED, body)
    body["tokens"] = [2]
    await log.append("s", 0, [opened()])
    (ev,) = await log.append("s", 1, [ne])
    assert ev.body == {"start": 0, "tokens": [1]}
    assert (await log.read("s"))[1] == ev
    assert ne.body_json == canonical_json({"start": 0, "tokens": [1]})
    with pytest.raises(InvalidValue):
        NewEvent(T.NOTE, {"x": float("nan")})


async def test_a_row_postgresql_refuses_in_the_copy_is_the_requests_fault(pg_url: str) -> None:
    """PostgreSQL writes events with one binary COPY: a value the server refuses
    there (a type longer than its column) fails that request alone with
    InvalidArgument, writes nothing of it, and the others of its batch commit."""
    from sessiontape.core.errors import InvalidArgument
    from sessiontape.core.log.postgres import PG_COPY_MIN_ROWS

    assert PG_COPY_MIN_ROWS <= 41
    log = await EventLog.open(pg_url)
    try:
        await log.append("a", 0, [opened()])
        await log.append("b", 0, [opened()])
        # enough rows for COPY (PG_COPY_MIN_ROWS), the last one refused
        bad = log.append("a", 1, [appended(i, [i]) for i in range(40)] + [NewEvent("x" * 65, {})])
        good = log.append("b", 1, [appended(0, [1])])
        results = await asyncio.gather(bad, good, return_exceptions=True)
        assert isinstance(results[0], InvalidArgument)
        assert not isinstance(results[1], BaseException)
        assert [e.version for e in await log.read("a")] == [1]
        assert [e.version for e in await log.read("b")] == [1, 2]
        # the log goes on: the next append to the refused session commits
        await log.append("a", 1, [appended(0, [2])])
        assert [e.version for e in await log.read("a")] == [1, 2]
    finally:
        await log.close()


async def test_an_append_that_is_not_a_list_of_new_events_is_refused_and_the_log_goes_on(
    log: EventLog,
) -> None:
    """A NewEvent is a tuple: passed without its list it must not be taken apart
    into 'events' (which once killed the writer when planned on the loop)."""
    from sessiontape.core.errors import InvalidArgument

    await log.append("s", 0, [opened()])
    await log.append("s", 1, [appended(0, [1])])  # the writer now plans from its cache
    with pytest.raises(InvalidArgument):
        await asyncio.wait_for(log.append("s", 2, appended(1, [2])), 10)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        await asyncio.wait_for(log.append("s", 2, [{"type": T.NOTE}]), 10)  # type: ignore[list-item]
    evs = await asyncio.wait_for(log.append("s", 2, [appended(1, [2])]), 10)
    assert [e.version for e in evs] == [3]
    assert [e.version for e in await log.read("s")] == [1, 2, 3]


async def test_a_request_that_cannot_be_planned_fails_alone(
    log: EventLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever goes wrong while a batch is planned ahead on the loop (here: an
    injected fault) makes the writer plan it again inside its transaction; it
    never kills the writer: the batch commits and later appends are served."""
    await log.append("a", 0, [opened()])
    await log.append("b", 0, [opened()])
    await log.append("a", 1, [appended(0, [1])])
    await log.append("b", 1, [appended(0, [1])])
    writer = log.writer
    real = writer.planner.plan
    faults = []

    def plan(cur: object, batch: list[Any], pos: int, head_of: Any, *, recheck: Any) -> Any:
        if recheck is None and not faults:  # planning ahead, from the cache
            faults.append(1)
            raise RuntimeError("a bug while planning")
        return real(cur, batch, pos, head_of, recheck=recheck)

    monkeypatch.setattr(writer.planner, "plan", plan)
    results = await asyncio.wait_for(
        asyncio.gather(
            log.append("a", 2, [appended(1, [2])]), log.append("b", 2, [appended(1, [2])])
        ),
        10,
    )
    assert faults == [1]
    assert [[e.version for e in r] for r in results] == [[3], [3]]
    evs = await asyncio.wait_for(log.append("a", 3, [appended(2, [3])]), 10)
    assert [e.version for e in evs] == [4]


def test_event_data_that_is_not_bytes_is_refused_when_the_event_is_made() -> None:
    with pytest.raises(InvalidValue):
        NewEvent(T.NOTE, {"text": "x"}, "not bytes")  # type: ignore[arg-type]


def test_a_new_event_copied_pickled_or_replaced_is_checked_and_encoded_again() -> None:
    import copy
    import pickle

    ne = NewEvent(T.NOTE, {"a": 1}, b"x")
    for again in (copy.copy(ne), copy.deepcopy(ne), pickle.loads(pickle.dumps(ne))):
        assert again == ne and isinstance(again, NewEvent)
    changed = ne._replace(body={"b": 2})
    assert changed.body_json == canonical_json({"b": 2}) and changed.data == b"x"
    with pytest.raises(InvalidValue):
        ne._replace(body={"x": float("inf")})
    with pytest.raises(TypeError):
        ne._replace(body_json="{}")


async def test_a_planned_batch_that_fails_drops_the_plan_made_after_it(log: EventLog) -> None:
    """The first planned batch fails inside its transaction (a hook raises once);
    the batch behind it was planned from what that one would have written, so it
    must be planned again: every append lands once, positions stay gapless."""
    sids = [f"p{i}" for i in range(12)]
    for sid in sids:
        await log.append(sid, 0, [opened()])
    failed = asyncio.Event()

    async def hook(_evs: list[object]) -> None:
        if not failed.is_set():
            failed.set()
            await asyncio.sleep(0.05)  # the next batch gets planned meanwhile
            raise RuntimeError("the disk hiccuped")

    log.writer.before_commit = hook

    async def writer(sid: str) -> list[BaseException | object]:
        out: list[BaseException | object] = []
        v = 1
        for k in range(4):
            try:
                await log.append(sid, v, [appended(k, [k])])
                v += 1
            except RuntimeError as exc:  # the failed batch's requests, retried alone, succeed
                out.append(exc)
        return out

    await asyncio.wait_for(asyncio.gather(*(writer(s) for s in sids)), 30)
    log.writer.before_commit = None
    assert failed.is_set()
    allev = await log.read_all(0, limit=10_000)
    assert [e.position for e in allev] == list(range(1, len(allev) + 1))
    for sid in sids:
        evs = await log.read(sid)
        verify_chain(evs)
        assert [e.version for e in evs] == list(range(1, len(evs) + 1))


async def test_the_next_transaction_starts_before_the_last_ones_appenders_resume(
    log: EventLog,
) -> None:
    """When a batch is waiting behind a transaction, the writer hands it to the
    database as soon as that transaction is over, and only then tells the
    finished batch's appenders: they would otherwise make their next events
    while the database sat idle."""
    await log.append("a", 0, [opened()])
    await log.append("b", 0, [opened()])
    seen: list[str] = []
    gate, held = asyncio.Event(), asyncio.Event()
    dialect = log.writer.dialect
    transaction = dialect.transaction

    append_batch = dialect.append_batch

    async def spied(*args: Any, **kwargs: Any) -> Any:
        seen.append("transaction")
        return await transaction(*args, **kwargs)

    async def spied_batch(*args: Any, **kwargs: Any) -> Any:
        # PostgreSQL's one-call transaction (a plan made ahead, with no hook)
        if dialect.shared:
            seen.append("transaction")
        return await append_batch(*args, **kwargs)

    async def hold(_evs: list[object]) -> None:
        log.writer.before_commit = None  # only the first transaction waits
        held.set()
        await gate.wait()

    async def append(sid: str) -> None:
        await log.append(sid, 1, [appended(0, [1])])
        seen.append(f"{sid} resumed")

    dialect.transaction = spied  # type: ignore[method-assign]
    dialect.append_batch = spied_batch  # type: ignore[method-assign]
    log.writer.before_commit = hold
    try:
        first = asyncio.create_task(append("a"))
        await asyncio.wait_for(held.wait(), 10)
        second = asyncio.create_task(append("b"))  # queued behind the held transaction
        await asyncio.sleep(0.05)
        assert seen == ["transaction"]
        gate.set()
        await asyncio.wait_for(asyncio.gather(first, second), 10)
    finally:
        dialect.transaction = transaction  # type: ignore[method-assign]
        dialect.append_batch = append_batch  # type: ignore[method-assign]
    assert seen == ["transaction", "transaction", "a resumed", "b resumed"]
    assert [e.version for e in await log.read("a")] == [1, 2]


# -- appends committed right away (Writer.commit_now) -------------------------


def _spy_transactions(log: EventLog) -> tuple[list[str], Any]:
    """Record each transaction the writer runs: ``now`` (on the loop, at once) or
    ``queued`` (the write loop's path); returns the record and an undo."""
    seen: list[str] = []
    dialect = log.writer.dialect
    transaction, transaction_now = dialect.transaction, dialect.transaction_now

    async def queued(*args: Any, **kwargs: Any) -> Any:
        seen.append("queued")
        return await transaction(*args, **kwargs)

    def now(work: Any) -> Any:
        result = transaction_now(work)  # NotNow (nothing run) is not a transaction
        seen.append("now")
        return result

    dialect.transaction = queued  # type: ignore[method-assign]
    dialect.transaction_now = now  # type: ignore[method-assign]

    def undo() -> None:
        dialect.transaction = transaction  # type: ignore[method-assign]
        dialect.transaction_now = transaction_now  # type: ignore[method-assign]

    return seen, undo


async def test_an_idle_writer_commits_an_append_at_once(db_url: str) -> None:
    """With nothing queued or in flight, an append commits without awaiting anything
    (SQLite; PostgreSQL's driver is async, so there it always queues), and its
    events are stored, chained and handed to subscribers like any other."""
    log = await EventLog.open(db_url)
    try:
        await log.append("s", 0, [opened()])
        await log.append("s", 1, [appended(0, [1])])  # the head is known from here on
        live = log.subscribe(2, "s")
        nxt = asyncio.ensure_future(anext(live))
        await asyncio.sleep(0.01)
        evs = log.append_now("s", 2, [appended(1, [2]), appended(2, [3])])
        if log.writer.dialect.shared:
            assert evs is None
            assert [e.version for e in await log.read("s")] == [1, 2]
            nxt.cancel()
            return
        assert evs is not None and [e.version for e in evs] == [3, 4]
        back = await log.read("s")
        assert back[2:] == evs
        verify_chain(back)
        assert await asyncio.wait_for(nxt, 5) == evs[0]
        row = await log.get_session("s")
        assert (row.version, row.head_hash) == (4, evs[-1].hash)
    finally:
        await log.close()


async def test_appends_made_in_one_turn_after_an_immediate_one_commit_together(
    sqlite_url: str,
) -> None:
    """Only one append per turn of the loop commits at once: the appends of other
    sessions woken in the same turn queue and share one transaction, as before."""
    log = await EventLog.open(sqlite_url)
    try:
        sids = [f"g{i}" for i in range(6)]
        for sid in sids:
            await log.append(sid, 0, [opened()])
        await asyncio.sleep(2 * NOW_IDLE_S)  # the writer has been idle a while
        seen, undo = _spy_transactions(log)

        async def append(sid: str) -> None:  # as the runtime appends
            if log.append_now(sid, 1, [appended(0, [7])]) is None:
                await log.append(sid, 1, [appended(0, [7])])

        try:
            await asyncio.gather(*(append(sid) for sid in sids))
        finally:
            undo()
        assert seen == ["now", "queued"]
        allev = await log.read_all(0, limit=100)
        assert [e.position for e in allev] == list(range(1, 13))
        assert [e.session_id for e in allev[6:]] == sids
    finally:
        await log.close()


async def test_an_append_while_a_batch_is_in_flight_waits_its_turn(sqlite_url: str) -> None:
    """While the write loop's transaction is out, nothing commits at once: the next
    append queues behind it, and subscribers get the events in log order."""
    log = await EventLog.open(sqlite_url)
    try:
        await log.append("a", 0, [opened()])
        await log.append("b", 0, [opened()])
        dialect = log.writer.dialect
        transaction = dialect.transaction
        gate, held = asyncio.Event(), asyncio.Event()

        async def slow(*args: Any, **kwargs: Any) -> Any:
            held.set()
            await gate.wait()
            return await transaction(*args, **kwargs)

        live = log.subscribe(2)
        got: list[tuple[str, int]] = []

        async def watch() -> None:
            async for e in live:
                got.append((e.session_id, e.position))
                if len(got) == 3:
                    return

        watcher = asyncio.create_task(watch())
        await asyncio.sleep(0.01)
        dialect.transaction = slow  # type: ignore[method-assign]
        try:
            first = asyncio.create_task(log.append("a", 1, [appended(0, [1]), appended(1, [2])]))
            await asyncio.wait_for(held.wait(), 5)
            assert log.append_now("b", 1, [appended(0, [3])]) is None  # nothing written
            second = asyncio.create_task(log.append("b", 1, [appended(0, [3])]))
            gate.set()
            await asyncio.wait_for(asyncio.gather(first, second), 5)
        finally:
            dialect.transaction = transaction  # type: ignore[method-assign]
        await asyncio.wait_for(watcher, 5)
        assert got == [("a", 3), ("a", 4), ("b", 5)]
    finally:
        await log.close()


async def test_an_append_that_cannot_commit_at_once_is_left_to_the_write_loop(
    sqlite_url: str,
) -> None:
    """A stale version, an unknown session, a commit that landed a moment ago and
    another connection's write lock all give None with nothing written (the
    loop never waits on the lock); the usual path then reports the conflict,
    or commits once the lock is gone."""
    log = await EventLog.open(sqlite_url)
    try:
        await log.append("s", 0, [opened()])
        assert log.append_now("s", 0, [appended(0, [1])]) is None  # stale
        with pytest.raises(ConcurrencyError):
            await log.append("s", 0, [appended(0, [1])])
        assert log.append_now("never-opened", 3, [appended(0, [1])]) is None
        assert [e.version for e in await log.read("s")] == [1]
        # right after another session's commit: left to the write loop, where the
        # next ones may gather; once the writer has been idle a while, at once
        await log.append("s", 1, [appended(0, [1])])
        await log.append("other", 0, [opened()])
        assert log.append_now("s", 2, [appended(1, [2])]) is None
        await asyncio.sleep(2 * NOW_IDLE_S)
        assert log.append_now("s", 2, [appended(1, [2])]) is not None
        await log.append("s", 3, [appended(2, [3])])
        await asyncio.sleep(2 * NOW_IDLE_S)

        path = sqlite_url.split("///", 1)[1]
        other = sqlite3.connect(path, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        try:
            t0 = time.perf_counter()
            assert log.append_now("s", 4, [appended(3, [4])]) is None
            assert time.perf_counter() - t0 < 1.0
            pending = asyncio.create_task(log.append("s", 4, [appended(3, [4])]))
            await asyncio.sleep(0.05)
            assert not pending.done()
        finally:
            other.execute("ROLLBACK")
            other.close()
        evs = await asyncio.wait_for(pending, 10)
        assert [e.version for e in evs] == [5]
        verify_chain(await log.read("s"))
    finally:
        await log.close()


async def test_an_append_right_after_its_own_sessions_commit_commits_at_once(
    sqlite_url: str,
) -> None:
    """A session that follows its own commit (a short turn's generation right after
    the turn's append) has nobody to gather with: it commits at once however soon it
    comes, while another session's append that soon still queues."""
    log = await EventLog.open(sqlite_url)
    try:
        await log.append("a", 0, [opened()])
        await log.append("b", 0, [opened()])
        await asyncio.sleep(2 * NOW_IDLE_S)
        seen, undo = _spy_transactions(log)
        try:
            assert log.append_now("a", 1, [appended(0, [1])]) is not None
            await asyncio.sleep(0)  # the next turn of the loop, well within NOW_IDLE_S
            assert log.append_now("a", 2, [appended(1, [2])]) is not None
            await asyncio.sleep(0)
            assert log.append_now("b", 1, [appended(0, [3])]) is None  # nothing written
            await log.append("b", 1, [appended(0, [3])])
        finally:
            undo()
        assert seen == ["now", "now", "queued"]
        assert [e.version for e in await log.read("a")] == [1, 2, 3]
        verify_chain(await log.read("a"))
        assert [e.version for e in await log.read("b")] == [1, 2]
    finally:
        await log.close()
