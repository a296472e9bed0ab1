"""salience.v1.Salience over real gRPC on loopback, against a real SQLite log."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from typing import Any

import grpc
import pytest

from sessiontape.core.engine.interface import EngineInfo, SamplingParams
from sessiontape.core.events import T
from sessiontape.core.generation.request import GenerateRequest
from sessiontape.engines.reference import EOS, ReferenceEngine
from sessiontape.engines.sampling import log_softmax, top_logprobs
from sessiontape.transports.grpc.gen.salience.v1 import salience_pb2 as spb
from tests.transports.grpc.tokensessions.conftest import Serve
from tests.transports.grpc.tokensessions.helpers import (
    IMAGE_BLOCK,
    PNG,
    dump,
    events,
    expect_code,
    generate,
    open_with,
    version,
    wait_finished,
)

Code = grpc.StatusCode
FR = spb.GenerateDone
PROMPT = list(b"The quick brown fox")


def rng(a: int, b: int) -> spb.PositionRange:
    return spb.PositionRange(start=a, end=b)


# -- lifecycle -----------------------------------------------------------------


async def test_open_session_checks_the_served_model(serve: Serve) -> None:
    s = await serve()
    for model in ("", "reference-bigram-v1"):
        r = await s.salience.OpenSession(spb.OpenSessionRequest(model=model))
        assert r.session_id and r.max_model_len == 4096
    before = len(await s.runtime.log.list_sessions())
    details = await expect_code(
        Code.FAILED_PRECONDITION, s.salience.OpenSession(spb.OpenSessionRequest(model="llama-70b"))
    )
    assert "model_mismatch" in details and "reference-bigram-v1" in details
    assert len(await s.runtime.log.list_sessions()) == before


async def test_bearer_token_is_required(serve: Serve) -> None:
    s = await serve()
    sid = await open_with(s.salience, PROMPT)
    for stub in (s.salience_stub(token=None), s.salience_stub(token="wrong")):
        await expect_code(Code.UNAUTHENTICATED, stub.OpenSession(spb.OpenSessionRequest()))
        await expect_code(
            Code.UNAUTHENTICATED,
            stub.Generate(
                spb.GenerateRequest(session_id=sid, append_tokens=[1], offset=len(PROMPT))
            ),
        )
    assert await dump(s.salience, sid) == PROMPT


async def test_close_is_idempotent_and_closed_sessions_are_not_found(serve: Serve) -> None:
    s = await serve()
    sid = await open_with(s.salience, PROMPT)
    await s.salience.CloseSession(spb.CloseSessionRequest(session_id=sid))
    await s.salience.CloseSession(spb.CloseSessionRequest(session_id=sid))
    assert [e.type for e in await events(s.runtime, sid)].count(T.SESSION_CLOSED) == 1
    await expect_code(
        Code.NOT_FOUND, s.salience.DumpSession(spb.DumpSessionRequest(session_id=sid))
    )
    await expect_code(
        Code.NOT_FOUND, s.salience.Generate(spb.GenerateRequest(session_id=sid, offset=len(PROMPT)))
    )
    await expect_code(
        Code.NOT_FOUND,
        s.salience.ForkSession(spb.ForkSessionRequest(session_id=sid, at_position=1)),
    )
    for unknown in ("s_nope", ""):
        await expect_code(
            Code.NOT_FOUND, s.salience.CloseSession(spb.CloseSessionRequest(session_id=unknown))
        )
        await expect_code(
            Code.NOT_FOUND, s.salience.DumpSession(spb.DumpSessionRequest(session_id=unknown))
        )
        await expect_code(
            Code.NOT_FOUND, s.salience.Generate(spb.GenerateRequest(session_id=unknown))
        )


async def test_idle_ttl_expires_and_a_noop_generate_refreshes_it(serve: Serve) -> None:
    s = await serve()
    sid = await open_with(s.salience, PROMPT)
    v = await version(s.runtime, sid)
    s.clock.advance(1700)
    _, done = await generate(s.salience, session_id=sid, offset=len(PROMPT))  # the no-op
    assert (done.completion_tokens, done.prompt_tokens) == (0, len(PROMPT))
    assert await version(s.runtime, sid) == v, "a TTL refresh records nothing"
    s.clock.advance(1700)  # 3400 s since open, 1700 since the refresh
    assert await dump(s.salience, sid) == PROMPT
    s.clock.advance(101)  # DumpSession does not refresh: 1801 s idle
    await expect_code(
        Code.NOT_FOUND, s.salience.DumpSession(spb.DumpSessionRequest(session_id=sid))
    )
    assert (await events(s.runtime, sid))[-1].type == T.SESSION_EXPIRED
    # closing an expired session is still fine (idempotent)
    await s.salience.CloseSession(spb.CloseSessionRequest(session_id=sid))


async def test_idle_ttl_comes_from_config(serve: Serve) -> None:
    s = await serve(sessions={"idle_ttl_s": {"salience": 60}})
    sid = await open_with(s.salience, PROMPT)
    s.clock.advance(61)
    await expect_code(
        Code.NOT_FOUND, s.salience.Generate(spb.GenerateRequest(session_id=sid, offset=len(PROMPT)))
    )


# -- generate ------------------------------------------------------------------


async def test_generate_appends_prefills_and_decodes(serve: Serve) -> None:
    s = await serve()
    sid = (await s.salience.OpenSession(spb.OpenSessionRequest())).session_id
    tokens, done = await generate(
        s.salience, session_id=sid, append_tokens=PROMPT, offset=0, max_tokens=6
    )
    n = len(PROMPT)
    assert [t.position for t in tokens] == list(range(n, n + 6))
    assert not any(t.is_prefill or t.has_sampled_logprob or t.logprobs or t.readout for t in tokens)
    assert (done.prompt_tokens, done.completion_tokens, done.total_tokens) == (n, 6, n + 6)
    assert done.finish_reason == FR.FINISH_REASON_LENGTH
    assert await dump(s.salience, sid) == PROMPT + [t.id for t in tokens]
    logged = [e.body["token"] for e in await events(s.runtime, sid, T.GENERATION_TOKEN)]
    assert logged == [t.id for t in tokens]
    # the next turn continues at the new length
    more, _ = await generate(
        s.salience, session_id=sid, append_tokens=[10], offset=n + 6, max_tokens=2
    )
    assert [t.position for t in more] == [n + 7, n + 8]


async def test_offset_drift_is_rejected_and_changes_nothing(serve: Serve) -> None:
    s = await serve()
    sid = await open_with(s.salience, PROMPT)
    n = len(PROMPT)
    v = await version(s.runtime, sid)
    for offset, truncating in ((n + 1, False), (n - 1, False), (n + 1, True), (0, False)):
        details = await expect_code(
            Code.FAILED_PRECONDITION,
            s.salience.Generate(
                spb.GenerateRequest(
                    session_id=sid,
                    append_tokens=[65],
                    offset=offset,
                    truncating=truncating,
                    max_tokens=3,
                )
            ),
        )
        assert "offset_mismatch" in details
    assert await dump(s.salience, sid) == PROMPT
    assert await version(s.runtime, sid) == v


async def test_truncating_rewinds_then_appends(serve: Serve) -> None:
    s = await serve()
    sid = await open_with(s.salience, PROMPT)
    tokens, done = await generate(
        s.salience,
        session_id=sid,
        append_tokens=[120, 121],
        offset=4,
        truncating=True,
        max_tokens=1,
    )
    assert done.prompt_tokens == 6 and tokens[0].position == 6
    assert await dump(s.salience, sid) == [*PROMPT[:4], 120, 121, tokens[0].id]
    [cut] = await events(s.runtime, sid, T.TOKENS_TRUNCATED)
    assert cut.body["reason"] == "rewind" and cut.body["dropped"] == len(PROMPT) - 4
    # truncating at the current length is a plain append
    await generate(s.salience, session_id=sid, append_tokens=[1], offset=7, truncating=True)
    assert len(await dump(s.salience, sid)) == 8


async def test_prefill_only_scores_exactly_the_requested_positions(serve: Serve) -> None:
    s = await serve()
    sid = await open_with(s.salience, PROMPT)
    engine = s.runtime.engine
    assert isinstance(engine, ReferenceEngine)
    tokens, done = await generate(
        s.salience,
        session_id=sid,
        offset=len(PROMPT),
        max_tokens=0,
        logprobs_ranges=[rng(2, 5), rng(9, 10)],
        logprob_top_k=3,
    )
    assert [t.position for t in tokens] == [2, 3, 4, 9]
    assert all(t.is_prefill and t.has_sampled_logprob and len(t.logprobs) == 3 for t in tokens)
    for t in tokens:
        assert t.id == PROMPT[t.position]
        lp = log_softmax(engine.logits(PROMPT, t.position))
        assert t.sampled_logprob == pytest.approx(lp[t.id], rel=1e-6)
        assert [a.id for a in t.logprobs] == [i for i, _ in top_logprobs(lp, 3)]
    assert (done.completion_tokens, done.finish_reason) == (0, FR.FINISH_REASON_LENGTH)
    assert await dump(s.salience, sid) == PROMPT
    # top_k 0: only the sampled token's logprob
    tokens, _ = await generate(
        s.salience, session_id=sid, offset=len(PROMPT), logprobs_ranges=[rng(0, 1)]
    )
    assert len(tokens) == 1 and tokens[0].has_sampled_logprob and not tokens[0].logprobs


async def test_logprobs_and_readouts_only_where_ranges_cover(serve: Serve) -> None:
    s = await serve()
    sid = await open_with(s.salience, PROMPT)
    n = len(PROMPT)
    tokens, _ = await generate(
        s.salience,
        session_id=sid,
        offset=n,
        max_tokens=4,
        logprob_top_k=2,
        logprobs_ranges=[rng(n + 1, n + 3)],
        readout_ranges=[rng(n - 1, n + 1)],
    )
    by_pos = {t.position: t for t in tokens}
    assert sorted(by_pos) == [n - 1, n, n + 1, n + 2, n + 3]
    assert by_pos[n - 1].is_prefill and not by_pos[n].is_prefill
    for p, t in by_pos.items():
        assert t.has_sampled_logprob == (n + 1 <= p < n + 3)
        assert len(t.logprobs) == (2 if n + 1 <= p < n + 3 else 0)
        assert len(t.readout) == (4 if n - 1 <= p < n + 1 else 0)  # 2 layers x 2 concepts
    manifest = await s.salience.GetReadoutManifest(spb.GetReadoutManifestRequest())
    assert (list(manifest.concepts), list(manifest.layers)) == (["bytes", "letters"], [0, 1])
    assert (manifest.hidden_size, manifest.dtype) == (8, "float32")
    engine = s.runtime.engine
    assert isinstance(engine, ReferenceEngine)
    history = await dump(s.salience, sid)
    assert list(by_pos[n - 1].readout) == pytest.approx(engine.readout(history, n - 1))


async def test_bad_arguments_are_invalid_and_change_nothing(serve: Serve) -> None:
    s = await serve()
    sid = await open_with(s.salience, PROMPT)
    n = len(PROMPT)
    v = await version(s.runtime, sid)
    bad: list[dict[str, Any]] = [
        {"append_tokens": [1, 259]},  # outside the vocabulary
        {"append_tokens": [1], "logprobs_ranges": [rng(3, 3)]},  # empty range
        {"append_tokens": [1], "logprobs_ranges": [rng(0, n + 5)]},  # beyond the history
        {"append_tokens": [1], "readout_ranges": [rng(5, 2)]},
        {"append_tokens": [1], "top_p": 1.5, "max_tokens": 1},
        {"append_tokens": [1], "temperature": -1.0, "max_tokens": 1},
    ]
    for fields in bad:
        await expect_code(
            Code.INVALID_ARGUMENT,
            s.salience.Generate(spb.GenerateRequest(session_id=sid, offset=n, **fields)),
        )
    assert await dump(s.salience, sid) == PROMPT
    assert await version(s.runtime, sid) == v


async def test_context_overflow_is_resource_exhausted(serve: Serve) -> None:
    s = await serve(engine=ReferenceEngine(max_length=64, eos_bias=-100.0))
    sid = await open_with(s.salience, PROMPT)
    await expect_code(
        Code.RESOURCE_EXHAUSTED,
        s.salience.Generate(
            spb.GenerateRequest(
                session_id=sid, append_tokens=[1] * (65 - len(PROMPT)), offset=len(PROMPT)
            )
        ),
    )
    assert await dump(s.salience, sid) == PROMPT
    # decoding into the limit stops there with LENGTH
    tokens, done = await generate(s.salience, session_id=sid, offset=len(PROMPT), max_tokens=100)
    assert len(tokens) == 64 - len(PROMPT) and done.finish_reason == FR.FINISH_REASON_LENGTH


async def test_stop_ids_and_eos_finish_with_eos(serve: Serve) -> None:
    s = await serve(engine=ReferenceEngine(eos_bias=60.0))
    sid = await open_with(s.salience, PROMPT)
    tokens, done = await generate(s.salience, session_id=sid, offset=len(PROMPT), max_tokens=8)
    assert [t.id for t in tokens] == [EOS] and done.finish_reason == FR.FINISH_REASON_EOS
    n = len(PROMPT) + 1
    tokens, done = await generate(
        s.salience,
        session_id=sid,
        offset=n,
        append_tokens=[1],
        max_tokens=8,
        stop_token_ids=list(range(256)),
        temperature=0.5,
    )
    assert len(tokens) == 1 and done.finish_reason == FR.FINISH_REASON_EOS
    [*_, fin] = await events(s.runtime, sid, T.GENERATION_FINISHED)
    assert fin.body["finish_reason"] in ("stop", "eos")


async def test_each_generate_draws_a_seed_and_records_it_so_replay_reproduces(serve: Serve) -> None:
    # Salience has no seed field: the log's seed is what makes the output reproducible.
    s = await serve()
    drawn = []
    for _ in range(2):
        sid = await open_with(s.salience, PROMPT)
        tokens, _ = await generate(
            s.salience, session_id=sid, offset=len(PROMPT), max_tokens=12, temperature=1.0
        )
        [*_, started] = await events(s.runtime, sid, T.GENERATION_STARTED)
        seed = int(started.body["params"]["seed"])  # JSON carries it as a decimal string
        assert 0 <= seed < 2**63
        drawn.append(seed)
        again = await s.runtime.open_session("salience")
        await s.runtime.append_tokens(again.session_id, PROMPT)
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=seed)
        redo = [
            int(e.body["token"])
            async for e in s.runtime.generate(again.session_id, GenerateRequest(params))
            if e.type == T.GENERATION_TOKEN and not e.body["is_prefill"]
        ]
        assert redo == [t.id for t in tokens if not t.is_prefill]
    assert drawn[0] != drawn[1], "each Generate draws its own seed"


async def test_priority_is_recorded(serve: Serve) -> None:
    s = await serve()
    sid = await open_with(s.salience, PROMPT)
    await generate(s.salience, session_id=sid, offset=len(PROMPT), max_tokens=1, priority=10)
    [*_, started] = await events(s.runtime, sid, T.GENERATION_STARTED)
    assert started.body["priority"] == 10


# -- images and forks ----------------------------------------------------------


def image(start: int, data: bytes = PNG, end: int | None = None) -> spb.ImageAttachment:
    return spb.ImageAttachment(
        bytes=data,
        mime="image/png",
        pad_range_start=start,
        pad_range_end=start + 10 if end is None else end,
    )


async def test_images_are_pad_runs_stored_in_the_log(serve: Serve) -> None:
    s = await serve()
    sid = await open_with(s.salience, [])
    history = [*PROMPT[:5], *IMAGE_BLOCK, *PROMPT[5:10]]
    await generate(s.salience, session_id=sid, append_tokens=history, offset=0, images=[image(5)])
    assert await dump(s.salience, sid) == history
    [att] = await events(s.runtime, sid, T.IMAGE_ATTACHED)
    assert att.data == PNG and att.body["mime"] == "image/png"
    assert await s.runtime.log.get_blob(hashlib.sha256(PNG).hexdigest()) == PNG  # content-addressed
    st = await s.runtime.get(sid)
    assert [(i.start, i.end) for i in st.images] == [(5, 15)]


async def test_bad_images_are_invalid_and_change_nothing(serve: Serve) -> None:
    s = await serve()
    sid = await open_with(s.salience, PROMPT[:3])
    v = await version(s.runtime, sid)
    block = [*IMAGE_BLOCK, 7]
    bad = [
        (block, [image(3, end=14)]),  # 11 tokens, the engine makes 10
        ([1, 2, *[258] * 7, 2, 2], [image(3)]),  # not a pad run
        (block, [image(0)]),  # outside the appended span
        (block, [image(3, data=b"")]),  # no bytes
        ([*IMAGE_BLOCK, *IMAGE_BLOCK], [image(3), image(8)]),  # overlapping
    ]
    for toks, imgs in bad:
        await expect_code(
            Code.INVALID_ARGUMENT,
            s.salience.Generate(
                spb.GenerateRequest(session_id=sid, append_tokens=toks, offset=3, images=imgs)
            ),
        )
    assert await dump(s.salience, sid) == PROMPT[:3]
    assert await version(s.runtime, sid) == v
    assert await s.runtime.log.get_blob(hashlib.sha256(PNG).hexdigest()) is None


class NoImages(ReferenceEngine):
    @property
    def info(self) -> EngineInfo:
        return dataclasses.replace(super().info, image_block_tokens=None, readout_manifest=None)


async def test_an_engine_without_images_or_readouts_refuses_them(serve: Serve) -> None:
    s = await serve(engine=NoImages())
    sid = await open_with(s.salience, [])
    v = await version(s.runtime, sid)
    details = await expect_code(
        Code.INVALID_ARGUMENT,
        s.salience.Generate(
            spb.GenerateRequest(
                session_id=sid, append_tokens=IMAGE_BLOCK, offset=0, images=[image(0)]
            )
        ),
    )
    assert "invalid_image" in details
    # the runtime's rule: refused before the append or generation.started is committed
    details = await expect_code(
        Code.INVALID_ARGUMENT,
        s.salience.Generate(
            spb.GenerateRequest(
                session_id=sid, append_tokens=[1], offset=0, readout_ranges=[rng(0, 1)]
            )
        ),
    )
    assert details.startswith("invalid_range: ") and "no readouts" in details
    assert await version(s.runtime, sid) == v
    manifest = await s.salience.GetReadoutManifest(spb.GetReadoutManifestRequest())
    assert not manifest.concepts
    assert await dump(s.salience, sid) == []


async def test_fork_at_and_inside_image_blocks(serve: Serve) -> None:
    s = await serve()
    sid = await open_with(s.salience, [])
    history = [*PROMPT[:5], *IMAGE_BLOCK, *PROMPT[5:10]]
    await generate(s.salience, session_id=sid, append_tokens=history, offset=0, images=[image(5)])

    async def fork(at: int) -> str:
        return str(
            (
                await s.salience.ForkSession(spb.ForkSessionRequest(session_id=sid, at_position=at))
            ).session_id
        )

    after = await fork(15)
    assert await dump(s.salience, after) == history[:15]
    assert [(i.start, i.end) for i in (await s.runtime.get(after)).images] == [(5, 15)]
    before = await fork(5)
    assert await dump(s.salience, before) == history[:5]
    assert (await s.runtime.get(before)).images == []
    for inside in (6, 10, 14):
        details = await expect_code(
            Code.FAILED_PRECONDITION,
            s.salience.ForkSession(spb.ForkSessionRequest(session_id=sid, at_position=inside)),
        )
        assert "image_block_split" in details
    await expect_code(
        Code.INVALID_ARGUMENT,
        s.salience.ForkSession(
            spb.ForkSessionRequest(session_id=sid, at_position=len(history) + 1)
        ),
    )
    await expect_code(
        Code.NOT_FOUND,
        s.salience.ForkSession(spb.ForkSessionRequest(session_id="s_x", at_position=0)),
    )
    # the child grows on its own; the parent is untouched
    tokens, _ = await generate(
        s.salience, session_id=before, append_tokens=[9], offset=5, max_tokens=3
    )
    assert await dump(s.salience, before) == [*history[:5], 9, *(t.id for t in tokens)]
    assert await dump(s.salience, sid) == history
    # a truncating rewind into the image block is refused too
    await expect_code(
        Code.FAILED_PRECONDITION,
        s.salience.Generate(
            spb.GenerateRequest(session_id=after, offset=8, truncating=True, append_tokens=[1])
        ),
    )


# -- concurrency and cancellation ---------------------------------------------


async def test_a_second_concurrent_generate_is_aborted(serve: Serve) -> None:
    s = await serve(
        engine=ReferenceEngine(step_delay_s=0.05, eos_bias=-100.0)
    )  # never EOS: Salience draws the seed
    sid = await open_with(s.salience, PROMPT)
    n = len(PROMPT)
    first = s.salience.Generate(spb.GenerateRequest(session_id=sid, offset=n, max_tokens=6))
    it = first.__aiter__()
    await it.__anext__()  # the first token: the generation is running
    v = await version(s.runtime, sid)
    details = await expect_code(
        Code.ABORTED,
        s.salience.Generate(
            spb.GenerateRequest(session_id=sid, offset=n + 1, append_tokens=[1], max_tokens=1)
        ),
    )
    assert "session_busy" in details
    rest = [ev async for ev in it]
    assert rest[-1].done.completion_tokens == 6
    assert await version(s.runtime, sid) > v
    assert len(await dump(s.salience, sid)) == n + 6


async def test_client_cancel_is_recorded_as_cancelled(serve: Serve) -> None:
    s = await serve(
        engine=ReferenceEngine(step_delay_s=0.05, eos_bias=-100.0)
    )  # never EOS: Salience draws the seed
    sid = await open_with(s.salience, PROMPT)
    call = s.salience.Generate(
        spb.GenerateRequest(session_id=sid, offset=len(PROMPT), max_tokens=200)
    )
    seen = []
    async for ev in call:
        seen.append(ev.token.id)
        if len(seen) == 2:
            call.cancel()
            break
    fin = await wait_finished(s.runtime, sid, "cancelled")
    assert fin.body["completion_tokens"] >= 2
    history = await dump(s.salience, sid)
    assert history[: len(PROMPT) + 2] == PROMPT + seen
    assert len(history) == len(PROMPT) + fin.body["completion_tokens"]
    # the session is free again
    await asyncio.sleep(0)
    tokens, _ = await generate(s.salience, session_id=sid, offset=len(history), max_tokens=1)
    assert len(tokens) == 1


async def test_server_shutdown_mid_generation_records_the_cancel(serve: Serve) -> None:
    s = await serve(
        engine=ReferenceEngine(step_delay_s=0.05, eos_bias=-100.0)
    )  # never EOS: Salience draws the seed
    sid = await open_with(s.salience, PROMPT)
    call = s.salience.Generate(
        spb.GenerateRequest(session_id=sid, offset=len(PROMPT), max_tokens=500)
    )
    it = call.__aiter__()
    await it.__anext__()
    await s.transport.stop(0.1)  # grace runs out: the call is cancelled, drain waits for its record
    [*_, fin] = await events(s.runtime, sid, T.GENERATION_FINISHED)
    assert fin.body["finish_reason"] == "cancelled"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in it:
            pass
    assert err.value.code() == Code.UNAVAILABLE  # the client sees the server go, never a Done
