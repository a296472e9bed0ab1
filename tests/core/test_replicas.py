"""Two runtimes on one PostgreSQL database behave as one service (replicas, in process).

Each runtime has its own log connection pool, state cache and writer lock
connection, exactly as two ``sessiontape serve`` processes would; the
multi-process version of these checks is tests/test_replicas_serve.py.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from sessiontape.core import metrics
from sessiontape.core.engine.interface import SamplingParams
from sessiontape.core.errors import LogUnavailable, OffsetMismatch, SessionBusy
from sessiontape.core.events import T
from sessiontape.core.generation.request import GenerateRequest
from sessiontape.core.log.postgres import PostgresDialect
from sessiontape.core.log.store import verify_chain
from sessiontape.core.runtime import Runtime
from sessiontape.engines.reference import ReferenceEngine
from tests.helpers.config import make_config
from tests.helpers.runtime import SpyEngine

pytestmark = pytest.mark.postgres


@pytest.fixture
async def pair(pg_url: str) -> AsyncIterator[tuple[Runtime, Runtime]]:
    a = await Runtime.create(make_config(pg_url), engine=ReferenceEngine(eos_bias=-1000.0))
    b = await Runtime.create(make_config(pg_url), engine=ReferenceEngine(eos_bias=-1000.0))
    try:
        yield a, b
    finally:
        await b.aclose()
        await a.aclose()


async def test_alternating_writes_across_replicas_never_conflict(
    pair: tuple[Runtime, Runtime],
) -> None:
    a, b = pair
    sid = (await a.open_session("http")).session_id
    await a.append_text(sid, "x")  # A caches the state
    await b.append_text(sid, "y")  # B loads it; A's cache is now stale
    for i in range(6):
        rt = (a, b)[i % 2]
        await rt.append_text(sid, str(i))
        await rt.record_feedback(sid, {"score": i})
        gen = [
            e async for e in rt.generate(sid, GenerateRequest(SamplingParams(max_tokens=3, seed=i)))
        ]
        assert gen[-1].type == T.GENERATION_FINISHED
    evs = await a.log.read(sid)
    verify_chain(evs)
    assert [e.version for e in evs] == list(range(1, len(evs) + 1))
    # both replicas' cached states catch up with the log they tail (no write needed)
    for _ in range(100):
        st_a, st_b = await a.get(sid), await b.get(sid)
        if st_a.version == st_b.version == evs[-1].version:
            break
        await asyncio.sleep(0.05)
    assert st_a.tokens == st_b.tokens and st_a.version == st_b.version == evs[-1].version


async def test_a_generation_on_a_state_another_replica_moved_on_begins_again(
    pair: tuple[Runtime, Runtime],
) -> None:
    """B appends, A generates at once on its cached state (its tail has not brought B's
    append yet): the first run's commit, which carries the generation's first append,
    finds the session moved on and writes nothing; the generation begins again on the
    reloaded state, so its prompt holds B's tokens and nothing is lost or doubled."""
    a, b = pair
    # A's follower drops a cached state once A's tail brings another replica's write;
    # stopped, it leaves A's state stale for every generation below (the race, made
    # certain: under load the tail sometimes won it every time)
    assert a._follower is not None
    a._follower.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await a._follower
    a._follower = None
    spy = SpyEngine(eos_bias=-1000.0)
    # the engine every part of A uses (generations decode on it)
    a.engine = a.sessions.engine = a.generations.engine = spy
    sid = (await a.open_session("http", eos_token_ids=[])).session_id
    await a.append_tokens(sid, [65])  # A caches the state
    before = metrics.STALE_RETRIES._value.get()
    for i in range(5):
        await b.append_tokens(sid, [70 + i])
        seen = [
            e
            async for e in a.generate(
                sid, GenerateRequest(SamplingParams(max_tokens=3, seed=i), append=[80])
            )
        ]
        assert seen[-1].body["finish_reason"] == "length"
        state = await b.sessions.load(sid)
        started = seen[0]
        assert started.type == T.GENERATION_STARTED
        prompt = state.tokens.tolist()[: started.body["prompt_length"]]
        assert prompt[-2:] == [70 + i, 80]  # B's append, then the request's
        assert spy.histories[-1] == prompt  # the engine started on that history
    evs = await a.log.read(sid)
    verify_chain(evs)
    assert [e.version for e in evs] == list(range(1, len(evs) + 1))
    assert sum(e.type == T.GENERATION_STARTED for e in evs) == 5
    appended = [e.body["tokens"] for e in evs if e.type == T.TOKENS_APPENDED]
    assert appended == [[65], *[[t] for i in range(5) for t in (70 + i, 80)]]
    # every generation began again, once: the engine started twice on each, first on the
    # stale history; the retry counter is the process's (other tests' runtimes count there too)
    assert len(spy.histories) == 10
    assert metrics.STALE_RETRIES._value.get() >= before + 5


async def test_a_real_conflict_still_gets_its_typed_error(pair: tuple[Runtime, Runtime]) -> None:
    a, b = pair
    sid = (await a.open_session("salience")).session_id
    await a.append_tokens(sid, [1, 2, 3], offset=0)
    await b.append_tokens(sid, [4], offset=3)
    # A's cached state says length 3: after the reload its offset no longer matches
    with pytest.raises(OffsetMismatch):
        await a.append_tokens(sid, [9], offset=3)
    assert list((await b.sessions.load(sid)).tokens) == [1, 2, 3, 4]


async def test_one_generation_per_session_across_replicas(pg_url: str) -> None:
    slow_a = ReferenceEngine(eos_bias=-1000.0, step_delay_s=0.01)
    a = await Runtime.create(make_config(pg_url), engine=slow_a)
    b = await Runtime.create(make_config(pg_url), engine=ReferenceEngine(eos_bias=-1000.0))
    try:
        sid = (await a.open_session("http")).session_id
        await a.append_text(sid, "hello")
        started = asyncio.Event()

        async def run_a() -> list[int]:
            toks = []
            async for e in a.generate(sid, GenerateRequest(SamplingParams(max_tokens=40, seed=1))):
                if e.type == T.GENERATION_TOKEN:
                    toks.append(int(e.body["token"]))
                    started.set()
            return toks

        task = asyncio.create_task(run_a())
        await asyncio.wait_for(started.wait(), 10)
        with pytest.raises(SessionBusy):
            async for _ in b.generate(sid, GenerateRequest(SamplingParams(max_tokens=5, seed=2))):
                pass
        toks = await task
        assert len(toks) == 40  # A's generation was not cut off
        fins = [e for e in await a.log.read(sid) if e.type == T.GENERATION_FINISHED]
        assert [f.body["finish_reason"] for f in fins] == ["length"]
        # free again: B generates next, on a state it reloads
        got = [
            e async for e in b.generate(sid, GenerateRequest(SamplingParams(max_tokens=3, seed=3)))
        ]
        assert got[-1].body["finish_reason"] == "length" and got[-1].body["prompt_tokens"] == 5 + 40
    finally:
        await b.aclose()
        await a.aclose()


async def test_a_replica_that_died_mid_generation_leaves_it_interrupted(pg_url: str) -> None:
    a = await Runtime.create(
        make_config(pg_url), engine=ReferenceEngine(eos_bias=-1000.0, step_delay_s=0.01)
    )
    b = await Runtime.create(make_config(pg_url), engine=ReferenceEngine(eos_bias=-1000.0))
    try:
        sid = (await a.open_session("http")).session_id
        await a.append_text(sid, "hello")
        agen = a.generate(sid, GenerateRequest(SamplingParams(max_tokens=400, seed=1)))
        async for e in agen:
            if e.type == T.GENERATION_TOKEN:
                break
        # A "dies": its lock connection drops (as with SIGKILL) and nothing more is recorded
        dialect = a.log.dialect
        assert isinstance(dialect, PostgresDialect)
        conn = dialect._lock_conn
        assert conn is not None
        dialect._lock_conn = None
        raw = await conn.get_raw_connection()
        raw.driver_connection.terminate()  # type: ignore[union-attr]
        await conn.invalidate()
        await conn.close()
        for _ in range(50):  # the server notices the dropped connection
            try:
                got = [
                    e
                    async for e in b.generate(
                        sid, GenerateRequest(SamplingParams(max_tokens=2, seed=2))
                    )
                ]
                break
            except SessionBusy:
                await asyncio.sleep(0.1)
        else:
            raise AssertionError("the dead replica's writer lock was never released")
        fins = [e for e in await b.log.read(sid) if e.type == T.GENERATION_FINISHED]
        assert fins[0].body["finish_reason"] == "interrupted"
        assert got[-1].type == T.GENERATION_FINISHED and got[-1].body["finish_reason"] == "length"
        verify_chain(await b.log.read(sid))
        # what was left of A finds the session moved on: it records nothing more
        await agen.aclose()  # type: ignore[attr-defined]
        evs = await b.log.read(sid)
        verify_chain(evs)
        assert [e.body["finish_reason"] for e in evs if e.type == T.GENERATION_FINISHED] == [
            "interrupted",
            "length",
        ]
    finally:
        await b.aclose()
        await a.aclose()


async def test_a_lost_lock_connection_is_a_typed_error_and_the_next_generation_reconnects(
    pair: tuple[Runtime, Runtime],
) -> None:
    a, b = pair
    sid = (await a.open_session("http")).session_id
    await a.append_text(sid, "hello")
    assert (
        len(
            [
                e
                async for e in a.generate(
                    sid, GenerateRequest(SamplingParams(max_tokens=3, seed=1))
                )
            ]
        )
        > 3
    )
    dialect = a.log.dialect
    assert isinstance(dialect, PostgresDialect) and dialect._lock_driver is not None
    lock_pid = dialect._lock_driver[1].get_server_pid()
    # the database ends the lock connection (a restart, an administrator, a proxy)
    [(ended,)] = await b.log.dialect.fetch(  # returns once it exited
        "SELECT pg_terminate_backend(?, 5000)", (lock_pid,)
    )
    assert ended
    before = [e.hash for e in await a.log.read(sid)]
    with pytest.raises(LogUnavailable):
        async for _ in a.generate(sid, GenerateRequest(SamplingParams(max_tokens=3, seed=2))):
            pass
    assert [e.hash for e in await a.log.read(sid)] == before  # nothing was written
    assert not a.generations.is_running(sid)
    got = [e async for e in a.generate(sid, GenerateRequest(SamplingParams(max_tokens=3, seed=3)))]
    assert got[-1].type == T.GENERATION_FINISHED
    assert dialect._lock_driver[1].get_server_pid() != lock_pid
    # and the lock is a real one again: the other replica cannot take it meanwhile
    agen = a.generate(sid, GenerateRequest(SamplingParams(max_tokens=400, seed=4)))
    await agen.__anext__()
    with pytest.raises(SessionBusy):
        async for _ in b.generate(sid, GenerateRequest(SamplingParams(max_tokens=2, seed=5))):
            pass
    await agen.aclose()  # type: ignore[attr-defined]
    verify_chain(await b.log.read(sid))


async def test_a_lock_call_cancelled_midway_leaves_no_lock_behind(
    pair: tuple[Runtime, Runtime],
) -> None:
    a, b = pair
    sid = (await a.open_session("http")).session_id
    for turns in range(3):  # cancelled before it is sent, while it runs, as it answers
        task = asyncio.ensure_future(a.log.try_lock_session(sid))
        for _ in range(turns):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # the other replica can take the session's writer lock: none was left held
        assert await b.log.try_lock_session(sid)
        await b.log.unlock_session(sid)
    got = [e async for e in a.generate(sid, GenerateRequest(SamplingParams(max_tokens=2, seed=1)))]
    assert got[-1].type == T.GENERATION_FINISHED


async def test_sweepers_on_every_replica_expire_a_session_once(pg_url: str) -> None:
    now = [1000.0]
    a = await Runtime.create(make_config(pg_url), engine=ReferenceEngine(), clock=lambda: now[0])
    b = await Runtime.create(make_config(pg_url), engine=ReferenceEngine(), clock=lambda: now[0])
    try:
        sids = [(await a.open_session("http", ttl_s=10)).session_id for _ in range(5)]
        for sid in sids:
            await b.get(sid)  # both replicas cache every session
        now[0] += 60
        got_a, got_b = await asyncio.gather(a.sessions.expire_idle(), b.sessions.expire_idle())
        assert sorted(got_a + got_b) == sorted(sids)
        for sid in sids:
            evs = await a.log.read(sid)
            assert [e.type for e in evs].count(T.SESSION_EXPIRED) == 1
            verify_chain(evs)
    finally:
        await b.aclose()
        await a.aclose()
