"""The runtime API: token history rules, generation, forks, TTL, busy, cancel."""

from __future__ import annotations

import asyncio

import pytest

from sessiontape.core.engine.interface import OutputOptions, SamplingParams
from sessiontape.core.errors import (
    AppendOnlyViolation,
    ContextOverflow,
    ImageBlockSplit,
    InvalidImage,
    InvalidParameters,
    InvalidRange,
    OffsetMismatch,
    SessionBusy,
    SessionClosed,
    SessionExpired,
    SessionNotFound,
    TokenOutOfVocabulary,
)
from sessiontape.core.events import T
from sessiontape.core.generation.request import GenerateRequest
from sessiontape.core.log.store import verify_chain
from sessiontape.core.runtime import Runtime
from sessiontape.core.tokens import ImageIn
from sessiontape.engines.reference import EOS, IMAGE_PAD, ReferenceEngine
from tests.helpers.config import make_config


async def unchanged(rt: Runtime, sid: str, version: int, tokens: list[int]) -> None:
    st = await rt.get(sid)
    assert (st.version, list(st.tokens)) == (version, tokens)
    fresh = await rt.sessions.load(sid)
    assert (fresh.version, list(fresh.tokens)) == (version, tokens)


async def test_offset_rule_and_truncating_rewind(any_runtime: Runtime) -> None:
    rt = any_runtime
    sid = (await rt.open_session("salience")).session_id
    assert await rt.append_tokens(sid, [1, 2, 3], offset=0) == 3
    for off, trunc in ((2, False), (4, False), (4, True)):
        with pytest.raises(OffsetMismatch):
            await rt.append_tokens(sid, [9], offset=off, truncating=trunc)
    await unchanged(rt, sid, 2, [1, 2, 3])
    assert await rt.append_tokens(sid, [7, 8], offset=1, truncating=True) == 3
    st = await rt.sessions.load(sid)
    assert list(st.tokens) == [1, 7, 8] and st.truncations == 1
    assert (await rt.log.get_session(sid)).history_length == 3


async def test_append_only_vocab_and_context(runtime: Runtime) -> None:
    sid = (await runtime.open_session("kakeya", mode="append_only")).session_id
    await runtime.append_tokens(sid, [1, 2])
    with pytest.raises(AppendOnlyViolation):
        await runtime.append_tokens(sid, [3], offset=1, truncating=True)
    with pytest.raises(TokenOutOfVocabulary):
        await runtime.append_tokens(sid, [5, 259])
    with pytest.raises(TokenOutOfVocabulary):
        await runtime.append_tokens(sid, [-1])
    with pytest.raises(ContextOverflow):
        await runtime.append_tokens(sid, [1] * 5000)
    await unchanged(runtime, sid, 2, [1, 2])


async def test_images_are_pad_runs_and_forks_respect_blocks(runtime: Runtime) -> None:
    sid = (await runtime.open_session("salience")).session_id
    block = [200] + [IMAGE_PAD] * 8 + [201]  # markers are ordinary ids here
    toks = [1, 2, *block, 3]
    img = ImageIn(data=b"\x89PNG fake", mime="image/png", start=2, end=12)
    bad = [
        ImageIn(b"x", "image/png", 2, 11),  # wrong length
        ImageIn(b"x", "image/png", 5, 15),  # outside the appended span
        ImageIn(b"", "image/png", 2, 12),  # no bytes
    ]
    for im in bad:
        with pytest.raises(InvalidImage):
            await runtime.append_tokens(sid, toks, offset=0, images=[im])
    with pytest.raises(InvalidImage):
        await runtime.append_tokens(
            sid, [1, 2] + [5] * 10 + [3], offset=0, images=[img]
        )  # not pad tokens
    await unchanged(runtime, sid, 1, [])
    await runtime.append_tokens(sid, toks, offset=0, images=[img])
    st = await runtime.get(sid)
    assert [(i.start, i.end, i.mime) for i in st.images] == [(2, 12, "image/png")]
    evs = await runtime.log.read(sid)
    [att] = [e for e in evs if e.type == T.IMAGE_ATTACHED]
    assert att.data == img.data
    with pytest.raises(ImageBlockSplit):
        await runtime.fork(sid, at_position=5)
    with pytest.raises(ImageBlockSplit):
        await runtime.append_tokens(sid, [1], offset=6, truncating=True)
    child = await runtime.fork(sid, at_position=12)
    assert len(child.images) == 1
    child2 = await runtime.fork(sid, at_position=2)
    assert child2.images == [] and list(child2.tokens) == [1, 2]
    assert list((await runtime.sessions.load(child2.session_id)).tokens) == [1, 2]


async def test_engine_without_images_rejects_them(sqlite_url: str) -> None:
    rt = await Runtime.create(make_config(sqlite_url), engine=ReferenceEngine(image_tokens=None))
    try:
        sid = (await rt.open_session("salience")).session_id
        with pytest.raises(InvalidImage, match="no images"):
            await rt.append_tokens(
                sid, [1] * 10, offset=0, images=[ImageIn(b"x", "image/png", 0, 10)]
            )
    finally:
        await rt.aclose()


async def collect(rt: Runtime, sid: str, params: SamplingParams, **kw: object) -> list:  # type: ignore[type-arg]
    return [e async for e in rt.generate(sid, GenerateRequest(params, **kw))]  # type: ignore[arg-type]


async def test_generation_is_logged_and_deterministic(any_runtime: Runtime) -> None:
    rt = any_runtime
    a = (await rt.open_session("test")).session_id
    await rt.append_text(a, "Hello there")
    evs = await collect(
        rt,
        a,
        SamplingParams(max_tokens=12, seed=42, temperature=0.8),
        options=OutputOptions(logprob_top_k=3),
    )
    assert [e.type for e in evs][:1] == [T.GENERATION_STARTED] and evs[
        -1
    ].type == T.GENERATION_FINISHED
    toks = [e.body["token"] for e in evs if e.type == T.GENERATION_TOKEN]
    assert evs[-1].body["completion_tokens"] == len(toks)
    assert all(
        len(e.body["top"]) == 3 and "logprob" in e.body for e in evs if e.type == T.GENERATION_TOKEN
    )
    # the same history built in three appends gives the same tokens (INV-3)
    b = (await rt.open_session("test")).session_id
    for part in ("Hel", "lo th", "ere"):
        await rt.append_text(b, part)
    evs_b = await collect(
        rt,
        b,
        SamplingParams(max_tokens=12, seed=42, temperature=0.8),
        options=OutputOptions(logprob_top_k=3),
    )
    assert [e.body for e in evs_b if e.type == T.GENERATION_TOKEN and True] != [] and [
        (e.body["token"], e.body["logprob"]) for e in evs_b if e.type == T.GENERATION_TOKEN
    ] == [(e.body["token"], e.body["logprob"]) for e in evs if e.type == T.GENERATION_TOKEN]
    st = await rt.sessions.load(a)
    assert list(st.tokens) == list(rt.engine.tokenize("Hello there")) + toks
    verify_chain(await rt.log.read(a))


async def test_prefill_only_scoring(runtime: Runtime) -> None:
    sid = (await runtime.open_session("salience")).session_id
    await runtime.append_tokens(sid, [10, 20, 30, 40, 50], offset=0)
    evs = await collect(
        runtime,
        sid,
        SamplingParams(max_tokens=0),
        options=OutputOptions(
            logprob_ranges=((1, 3),), readout_ranges=((4, 5),), generated_logprobs=False
        ),
    )
    toks = [e.body for e in evs if e.type == T.GENERATION_TOKEN]
    assert [(t["position"], t["is_prefill"]) for t in toks] == [(1, True), (2, True), (4, True)]
    assert "logprob" in toks[0] and "readout" not in toks[0] and "readout" in toks[2]
    assert len((await runtime.get(sid)).tokens) == 5
    with pytest.raises(InvalidRange):
        await collect(
            runtime,
            sid,
            SamplingParams(max_tokens=0),
            options=OutputOptions(logprob_ranges=((3, 9),)),
        )
    with pytest.raises(InvalidParameters):
        await collect(runtime, sid, SamplingParams(max_tokens=1, top_p=0))


async def test_stop_and_eos(runtime: Runtime) -> None:
    sid = (await runtime.open_session("t")).session_id
    await runtime.append_text(sid, "abc")
    evs = await collect(runtime, sid, SamplingParams(max_tokens=50, temperature=0))
    first = next(e.body["token"] for e in evs if e.type == T.GENERATION_TOKEN)
    sid2 = (await runtime.open_session("t")).session_id
    await runtime.append_text(sid2, "abc")
    evs2 = await collect(
        runtime, sid2, SamplingParams(max_tokens=50, temperature=0, stop_token_ids=(first,))
    )
    assert evs2[-1].body["finish_reason"] == "stop" and evs2[-1].body["completion_tokens"] == 1
    sid3 = (await runtime.open_session("t", eos_token_ids=[first])).session_id
    await runtime.append_text(sid3, "abc")
    evs3 = await collect(runtime, sid3, SamplingParams(max_tokens=50, temperature=0))
    assert evs3[-1].body["finish_reason"] == "eos"
    assert EOS not in (await runtime.get(sid3)).eos_token_ids


async def test_second_generate_is_busy_and_cancel_is_recorded(sqlite_url: str) -> None:
    rt = await Runtime.create(make_config(sqlite_url), engine=ReferenceEngine(step_delay_s=0.02))
    try:
        sid = (await rt.open_session("t")).session_id
        await rt.append_text(sid, "hi")
        gen = rt.generate(sid, GenerateRequest(SamplingParams(max_tokens=200, seed=1)))
        first = await anext(gen)
        assert first.type == T.GENERATION_STARTED
        with pytest.raises(SessionBusy):
            await collect(rt, sid, SamplingParams(max_tokens=1))
        with pytest.raises(SessionBusy):
            await rt.append_tokens(sid, [1])
        await anext(gen)
        await gen.aclose()
        st = await rt.sessions.load(sid)
        [g] = st.generations.values()
        assert g.finish_reason == "cancelled" and len(g.tokens) == 1
        await collect(rt, sid, SamplingParams(max_tokens=2, seed=1))  # free again
    finally:
        await rt.aclose()


async def test_task_cancellation_is_recorded(sqlite_url: str) -> None:
    rt = await Runtime.create(make_config(sqlite_url), engine=ReferenceEngine(step_delay_s=0.02))
    try:
        sid = (await rt.open_session("t")).session_id
        seen = asyncio.Event()

        async def consume() -> None:
            async for e in rt.generate(
                sid, GenerateRequest(SamplingParams(max_tokens=500, seed=3))
            ):
                if e.type == T.GENERATION_TOKEN:
                    seen.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(seen.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        [g] = (await rt.sessions.load(sid)).generations.values()
        assert g.finish_reason == "cancelled"
    finally:
        await rt.aclose()


async def test_fork_at_event_version_and_close(runtime: Runtime) -> None:
    sid = (await runtime.open_session("t")).session_id
    await runtime.append_tokens(sid, [1, 2])
    await runtime.append_tokens(sid, [3])
    child = await runtime.fork(sid, at_version=2)
    assert list(child.tokens) == [1, 2] and child.parent == {
        "session_id": sid,
        "version": 2,
        "token_position": None,
    }
    evs = await runtime.log.read(child.session_id)
    assert len(evs) == 1  # nothing copied
    row = await runtime.log.get_session(child.session_id)
    assert row.parent_id == sid and row.parent_version == 2
    with pytest.raises(InvalidParameters):
        await runtime.fork(sid, at_version=99)
    await runtime.close(sid)
    await runtime.close(sid)  # idempotent
    with pytest.raises(SessionClosed):
        await runtime.append_tokens(sid, [1])
    with pytest.raises(SessionNotFound):
        await runtime.close("s_nope")
    # a closed parent can still be forked (replay and branch from history)
    g = await runtime.fork(sid, at_position=1)
    assert list((await runtime.sessions.load(g.session_id)).tokens) == [1]


async def test_idle_ttl_expiry_by_sweeper_and_on_access(sqlite_url: str) -> None:
    now = [1000.0]
    rt = await Runtime.create(
        make_config(sqlite_url, sessions={"idle_ttl_s": {"default": 60.0}}),
        engine=ReferenceEngine(),
        clock=lambda: now[0],
    )
    try:
        a = (await rt.open_session("t")).session_id
        b = (await rt.open_session("t")).session_id
        c = (await rt.open_session("t", ttl_s=600)).session_id
        now[0] += 30
        await rt.sessions.touch(b)
        now[0] += 40  # a idle 70 s, b idle 40 s
        assert await rt.sessions.expire_idle() == [a]
        with pytest.raises(SessionExpired):
            await rt.append_tokens(a, [1])
        now[0] += 30  # b idle 70 s: expires on access even before a sweep
        with pytest.raises(SessionExpired):
            await rt.append_tokens(b, [1])
        await rt.append_tokens(c, [1])
        assert (await rt.log.get_session(a)).status == "expired"
        assert (await rt.log.get_session(b)).status == "expired"
        assert (await rt.sessions.load(c)).status == "open"
    finally:
        await rt.aclose()


async def test_snapshots_make_loading_cheap_and_identical(sqlite_url: str) -> None:
    rt = await Runtime.create(
        make_config(sqlite_url, log={"snapshot_every": 10}), engine=ReferenceEngine()
    )
    try:
        sid = (await rt.open_session("t")).session_id
        for i in range(25):
            await rt.append_tokens(sid, [i])
        await asyncio.sleep(0.05)
        for t in list(rt.sessions._background):
            await t
        snap = await rt.log.load_snapshot(sid)
        assert snap is not None and snap[0] >= 10
        live = await rt.get(sid)
        loaded = await rt.sessions.load(sid)
        assert list(loaded.tokens) == list(live.tokens) and loaded.version == live.version
        assert loaded.head_hash == live.head_hash
    finally:
        await rt.aclose()


async def test_a_fork_of_a_generating_session_does_not_inherit_its_running_generation(
    runtime: Runtime,
) -> None:
    """The parent's running generation stays the parent's: the child starts idle, its
    first generate records nothing about it, and the parent's generation runs on."""
    engine = runtime.engine
    assert isinstance(engine, ReferenceEngine)
    engine.step_delay_s = 0.005
    s = await runtime.open_session("http", eos_token_ids=[])
    await runtime.append_text(s.session_id, "parent")
    five = asyncio.Event()
    finished: list[str] = []

    async def parent_generates() -> None:
        seen = 0
        async for e in runtime.generate(
            s.session_id, GenerateRequest(SamplingParams(max_tokens=40, seed=3))
        ):
            seen += e.type == T.GENERATION_TOKEN
            if seen == 5:
                five.set()
            if e.type == T.GENERATION_FINISHED:
                finished.append(e.body["finish_reason"])

    task = asyncio.create_task(parent_generates())
    await five.wait()
    parent = await runtime.get(s.session_id)
    assert parent.active_generation is not None  # the parent is generating
    child = await runtime.fork(s.session_id, at_position=parent.length)
    assert child.active_generation is None
    evs = [
        e
        async for e in runtime.generate(
            child.session_id, GenerateRequest(SamplingParams(max_tokens=3, seed=1))
        )
    ]
    own = [e for e in evs if e.type == T.GENERATION_FINISHED]
    assert len(own) == 1 and own[0].body["finish_reason"] != "interrupted"
    log = await runtime.log.read(child.session_id, 1, None)
    assert [e.body["finish_reason"] for e in log if e.type == T.GENERATION_FINISHED] == [
        own[0].body["finish_reason"]
    ]
    # rebuilt from the log (the loader's fork path), the child agrees
    again = await runtime.sessions.load(child.session_id)
    assert again.active_generation is None and len(again.generations) == len(
        (await runtime.get(child.session_id)).generations
    )
    await task
    assert finished == ["length"]  # the parent's generation ran on to its end


async def test_a_resume_cursor_exists_from_memory_or_from_the_log(sqlite_url: str) -> None:
    """``position_exists`` answers from memory what this process committed or found
    when it opened the log, and reads the log for what it did not see (another
    process's commits); a position past the log's end never exists."""
    rt = await Runtime.create(make_config(sqlite_url), engine=ReferenceEngine())
    try:
        st = await rt.open_session("test")
        await rt.append_tokens(st.session_id, [1, 2, 3])
        end = await rt.reads.last_position()
        assert rt.log.known_end() == end
        assert await rt.reads.position_exists(end) and not await rt.reads.position_exists(end + 1)
    finally:
        await rt.aclose()
    again = await Runtime.create(make_config(sqlite_url), engine=ReferenceEngine())
    try:
        assert again.log.known_end() == end  # read once as it opened the log
        assert await again.reads.position_exists(end) and await again.reads.position_exists(1)
        assert not await again.reads.position_exists(end + 1)
    finally:
        await again.aclose()


async def test_the_runtime_is_made_of_named_parts_sharing_one_state(runtime: Runtime) -> None:
    """No mixin chain: the runtime holds its parts, and they share the one cache of
    states and the one set of running generations."""
    assert Runtime.__bases__ == (object,)
    rt = runtime
    sid = (await rt.open_session("test")).session_id
    await rt.append_text(sid, "Hi")
    assert await rt.get(sid) is await rt.sessions.get(sid)
    assert rt.nodes.sessions is rt.sessions and rt.generations.sessions is rt.sessions
    assert rt.sessions.running is rt.generations.running
    runs = rt.generate_runs(sid, GenerateRequest(SamplingParams(max_tokens=40, seed=1)))
    first = await anext(runs)  # type: ignore[call-overload]
    assert first and rt.generations.is_running(sid)
    await runs.aclose()  # type: ignore[attr-defined]
    assert not rt.generations.is_running(sid)
    assert [e.version for e in await rt.reads.read_events(sid)][-1] == (await rt.get(sid)).version
