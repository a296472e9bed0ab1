"""kakeya.v1.RuntimeService over real gRPC on loopback, against a real SQLite log."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessiontape.core.engine.interface import Engine, SamplingParams, Step
from sessiontape.core.engine.worker import WorkerEngine
from sessiontape.core.events import T
from sessiontape.engines.reference import EOS, ReferenceEngine
from sessiontape.transports.grpc.gen.kakeya.v1 import runtime_pb2 as kpb
from sessiontape.transports.grpc.gen.kakeya.v1 import runtime_pb2_grpc as kakeya_grpc
from tests.transports.grpc.tokensessions.conftest import Serve
from tests.transports.grpc.tokensessions.helpers import events, expect_code, version, wait_finished

Code = grpc.StatusCode
Done = kpb.GenerateDone
U64_MAX = 2**64 - 1


async def create(
    stub: Any, history: Sequence[int] = (), *, eos: Sequence[int] = (), label: str = ""
) -> str:
    sid = str(
        (
            await stub.CreateSession(
                kpb.CreateSessionRequest(client_label=label, eos_token_ids=list(eos))
            )
        ).session_id
    )
    if history:
        await stub.AppendTokens(kpb.AppendTokensRequest(session_id=sid, token_ids=list(history)))
    return sid


async def run(stub: Any, sid: str, **fields: Any) -> tuple[list[int], Any, list[Any]]:
    """Generate: (token ids, done, truncated messages); checks the stream's shape."""
    tokens: list[int] = []
    truncated: list[Any] = []
    done = None
    async for ev in stub.Generate(kpb.GenerateRequest(session_id=sid, **fields)):
        kind = ev.WhichOneof("payload")
        assert done is None, "exactly one done, last"
        if kind == "truncated":
            assert not tokens and not truncated, "truncated comes at most once, before any token"
            truncated.append(ev.truncated)
        elif kind == "token_id":
            tokens.append(ev.token_id)
        else:
            done = ev.done
    assert done is not None
    return tokens, done, truncated


async def info(stub: Any, sid: str) -> Any:
    return await stub.GetSessionInfo(kpb.GetSessionInfoRequest(session_id=sid))


def served_engine(process: str, **options: Any) -> Engine:
    """The reference engine in this process, or served from a worker process."""
    if process == "worker":
        return WorkerEngine("reference", options)
    return ReferenceEngine(**options)


@pytest.mark.parametrize("process", ["inline", "worker"])
async def test_create_append_generate_close(serve: Serve, process: str) -> None:
    s = await serve(engine=served_engine(process, eos_bias=-100.0))
    sid = await create(s.kakeya, label="sdk-test", eos=[7, 8])
    [opened] = await events(s.runtime, sid, T.SESSION_OPENED)
    assert opened.body["label"] == "sdk-test" and opened.body["eos_token_ids"] == [7, 8]
    assert opened.body["mode"] == "append_only"
    for n, chunk in ((3, [1, 2, 3]), (3, []), (5, [4, 5])):
        r = await s.kakeya.AppendTokens(kpb.AppendTokensRequest(session_id=sid, token_ids=chunk))
        assert r.history_length == n
    tokens, done, truncated = await run(s.kakeya, sid, max_tokens=4, seed=3, temperature=0.0)
    assert not truncated and len(tokens) == done.generated_token_count
    assert done.stop_reason in (Done.STOP_REASON_MAX_TOKENS, Done.STOP_REASON_EOS)
    assert 0 <= done.prefill_duration_seconds <= done.total_duration_seconds
    i = await info(s.kakeya, sid)
    assert i.history_length == 5 + len(tokens)
    assert (
        i.kv_live_bytes,
        i.cache_invariant_inv1_violations,
        i.cache_invariant_inv2_violations,
    ) == (0, 0, 0)
    r = await s.kakeya.CloseSession(kpb.CloseSessionRequest(session_id=sid))
    assert r.final_history_length == 5 + len(tokens)
    # closed: every later call is NOT_FOUND, CloseSession included
    await expect_code(
        Code.NOT_FOUND, s.kakeya.CloseSession(kpb.CloseSessionRequest(session_id=sid))
    )
    await expect_code(
        Code.NOT_FOUND,
        s.kakeya.AppendTokens(kpb.AppendTokensRequest(session_id=sid, token_ids=[1])),
    )
    await expect_code(
        Code.NOT_FOUND, s.kakeya.Generate(kpb.GenerateRequest(session_id=sid, max_tokens=1))
    )
    await expect_code(
        Code.NOT_FOUND, s.kakeya.GetSessionInfo(kpb.GetSessionInfoRequest(session_id=sid))
    )


async def test_unknown_sessions_and_auth(serve: Serve) -> None:
    s = await serve()
    for sid in ("s_fabricated", ""):
        await expect_code(
            Code.NOT_FOUND,
            s.kakeya.AppendTokens(kpb.AppendTokensRequest(session_id=sid, token_ids=[1])),
        )
        await expect_code(
            Code.NOT_FOUND, s.kakeya.Generate(kpb.GenerateRequest(session_id=sid, max_tokens=1))
        )
        await expect_code(
            Code.NOT_FOUND, s.kakeya.GetSessionInfo(kpb.GetSessionInfoRequest(session_id=sid))
        )
        await expect_code(
            Code.NOT_FOUND, s.kakeya.CloseSession(kpb.CloseSessionRequest(session_id=sid))
        )
    await expect_code(
        Code.UNAUTHENTICATED, s.kakeya_stub(token=None).CreateSession(kpb.CreateSessionRequest())
    )
    await expect_code(
        Code.UNAUTHENTICATED,
        s.kakeya_stub(token="nope").Generate(kpb.GenerateRequest(session_id="s_x", max_tokens=1)),
    )
    assert await s.runtime.log.list_sessions() == []


async def test_out_of_vocabulary_append_changes_nothing(serve: Serve) -> None:
    s = await serve()
    sid = await create(s.kakeya, [1, 2, 3])
    v = await version(s.runtime, sid)
    for bad in ([4, 259], [2**32 - 1], [258, 1000]):
        details = await expect_code(
            Code.INVALID_ARGUMENT,
            s.kakeya.AppendTokens(kpb.AppendTokensRequest(session_id=sid, token_ids=bad)),
        )
        assert "token_out_of_vocabulary" in details
    # eos ids are the application's opaque ids: one outside the vocabulary is accepted (it never matches)
    opaque = (
        await s.kakeya.CreateSession(kpb.CreateSessionRequest(eos_token_ids=[300, 2**32 - 1]))
    ).session_id
    assert list((await s.runtime.get(opaque)).eos_token_ids) == [300, 2**32 - 1]
    assert (await info(s.kakeya, sid)).history_length == 3
    assert await version(s.runtime, sid) == v
    assert list((await s.runtime.get(sid)).tokens) == [1, 2, 3]


async def test_eos_ids_are_the_sessions_own(serve: Serve) -> None:
    s = await serve(engine=ReferenceEngine(eos_bias=60.0))  # the engine's EOS wins every draw
    with_eos = await create(s.kakeya, [1, 2], eos=[EOS])
    tokens, done, _ = await run(s.kakeya, with_eos, max_tokens=5, seed=1)
    assert (
        tokens == [EOS]
        and done.stop_reason == Done.STOP_REASON_EOS
        and done.generated_token_count == 1
    )
    # no eos ids: the runtime gives the ids no meaning, only max_tokens stops it
    without = await create(s.kakeya, [1, 2])
    tokens, done, _ = await run(s.kakeya, without, max_tokens=5, seed=1)
    assert tokens == [EOS] * 5 and done.stop_reason == Done.STOP_REASON_MAX_TOKENS


async def test_uint64_seeds_are_exact_and_pin_the_output(serve: Serve) -> None:
    s = await serve()
    outs = []
    for seed in (U64_MAX, U64_MAX, U64_MAX - 1, 0):
        sid = await create(s.kakeya, list(b"seeded"))
        tokens, _, _ = await run(s.kakeya, sid, max_tokens=12, seed=seed, temperature=1.0)
        [started] = await events(s.runtime, sid, T.GENERATION_STARTED)
        assert int(started.body["params"]["seed"]) == seed
        outs.append(tokens)
    assert outs[0] == outs[1]
    assert outs[0] != outs[2] or outs[0] != outs[3]


async def test_an_unset_seed_is_drawn_and_recorded_so_the_output_reproduces(serve: Serve) -> None:
    s = await serve()
    drawn, outs = [], []
    for _ in range(2):
        sid = await create(s.kakeya, list(b"unseeded"))
        tokens, _, _ = await run(s.kakeya, sid, max_tokens=12, temperature=1.0)
        [started] = await events(s.runtime, sid, T.GENERATION_STARTED)
        seed = int(started.body["params"]["seed"])  # JSON carries it as a decimal string
        assert 0 <= seed < 2**63
        drawn.append(seed)
        outs.append(tokens)
    assert drawn[0] != drawn[1], "each unseeded Generate draws its own seed"
    # the recorded seed, pinned on the same history, gives the same tokens
    for seed, tokens in zip(drawn, outs, strict=True):
        again = await create(s.kakeya, list(b"unseeded"))
        assert (await run(s.kakeya, again, max_tokens=12, temperature=1.0, seed=seed))[0] == tokens


async def test_bad_sampling_parameters_are_invalid(serve: Serve) -> None:
    s = await serve()
    sid = await create(s.kakeya, [1, 2])
    v = await version(s.runtime, sid)
    bad: list[dict[str, Any]] = [{"top_p": 0.0}, {"top_p": 1.5}, {"temperature": -0.5}]
    for fields in bad:
        await expect_code(
            Code.INVALID_ARGUMENT,
            s.kakeya.Generate(kpb.GenerateRequest(session_id=sid, max_tokens=2, **fields)),
        )
    assert await version(s.runtime, sid) == v


async def test_sink_window_truncation(serve: Serve) -> None:
    s = await serve(options={"sink": 4, "window": 8})
    history = list(range(20))
    sid = await create(s.kakeya, history)
    tokens, done, truncated = await run(s.kakeya, sid, max_tokens=3, seed=5, temperature=0.0)
    assert [t.dropped_token_count for t in truncated] == [20 - 12]
    assert done.generated_token_count == len(tokens) == 3
    assert list((await s.runtime.get(sid)).tokens) == [*history[:4], *history[12:], *tokens]
    [cut] = await events(s.runtime, sid, T.TOKENS_TRUNCATED)
    assert (cut.body["reason"], cut.body["sink"], cut.body["window"], cut.body["dropped"]) == (
        "sink_window",
        4,
        8,
        8,
    )
    assert (await info(s.kakeya, sid)).history_length == 15
    # the next call truncates again, by what the last one added
    _, _, truncated = await run(s.kakeya, sid, max_tokens=1, seed=5)
    assert [t.dropped_token_count for t in truncated] == [3]
    # a history inside the slab is left alone
    short = await create(s.kakeya, list(range(12)))
    _, _, truncated = await run(s.kakeya, short, max_tokens=2, seed=5)
    assert truncated == []


async def test_truncation_is_off_by_default(serve: Serve) -> None:
    s = await serve()
    sid = await create(s.kakeya, list(range(200)))
    _, _, truncated = await run(s.kakeya, sid, max_tokens=1, seed=1)
    assert truncated == [] and await events(s.runtime, sid, T.TOKENS_TRUNCATED) == []


async def test_a_full_context_stops_with_truncated_and_overflow_is_resource_exhausted(
    serve: Serve,
) -> None:
    s = await serve(engine=ReferenceEngine(max_length=32, eos_bias=-100.0))
    sid = await create(s.kakeya, list(range(30)))
    tokens, done, _ = await run(s.kakeya, sid, max_tokens=5, seed=2)
    assert len(tokens) == 2 and done.stop_reason == Done.STOP_REASON_TRUNCATED
    await expect_code(
        Code.RESOURCE_EXHAUSTED,
        s.kakeya.AppendTokens(kpb.AppendTokensRequest(session_id=sid, token_ids=[1])),
    )
    assert (await info(s.kakeya, sid)).history_length == 32


async def test_idle_ttl_and_idle_seconds(serve: Serve) -> None:
    s = await serve()
    sid = await create(s.kakeya, [1, 2, 3])
    s.clock.advance(100)
    assert (await info(s.kakeya, sid)).idle_seconds == pytest.approx(100, abs=1)
    s.clock.advance(1650)
    await s.kakeya.AppendTokens(kpb.AppendTokensRequest(session_id=sid, token_ids=[4]))  # refreshes
    assert (await info(s.kakeya, sid)).idle_seconds == pytest.approx(0, abs=1)
    s.clock.advance(1801)
    await expect_code(
        Code.NOT_FOUND,
        s.kakeya.AppendTokens(kpb.AppendTokensRequest(session_id=sid, token_ids=[5])),
    )
    assert (await events(s.runtime, sid))[-1].type == T.SESSION_EXPIRED


async def test_concurrent_generate_and_append_are_aborted(serve: Serve) -> None:
    s = await serve(engine=ReferenceEngine(step_delay_s=0.05))
    sid = await create(s.kakeya, [1, 2, 3])
    call = s.kakeya.Generate(kpb.GenerateRequest(session_id=sid, max_tokens=5, seed=1))
    it = call.__aiter__()
    await it.__anext__()
    await expect_code(
        Code.ABORTED, s.kakeya.Generate(kpb.GenerateRequest(session_id=sid, max_tokens=1, seed=1))
    )
    await expect_code(
        Code.ABORTED, s.kakeya.AppendTokens(kpb.AppendTokensRequest(session_id=sid, token_ids=[9]))
    )
    rest = [ev async for ev in it]
    assert rest[-1].done.generated_token_count == 5
    assert (await info(s.kakeya, sid)).history_length == 8


@pytest.mark.parametrize("process", ["inline", "worker"])
async def test_client_cancel_is_recorded_as_cancelled(serve: Serve, process: str) -> None:
    s = await serve(engine=served_engine(process, step_delay_s=0.05))
    sid = await create(s.kakeya, [1, 2, 3])
    call = s.kakeya.Generate(kpb.GenerateRequest(session_id=sid, max_tokens=500, seed=1))
    seen = []
    async for ev in call:
        seen.append(ev.token_id)
        if len(seen) == 3:
            call.cancel()
            break
    fin = await wait_finished(s.runtime, sid, "cancelled")
    st = await s.runtime.get(sid)
    assert list(st.tokens)[3:6] == seen and len(st.tokens) == 3 + fin.body["completion_tokens"]
    tokens, _, _ = await run(s.kakeya, sid, max_tokens=1, seed=1)  # usable again
    assert len(tokens) == 1


class LyingCache(ReferenceEngine):
    """Claims a cache longer than the history: the runtime must count INV-1."""

    def cached_length(self, session_key: str) -> int | None:
        return 10**6


class BackwardsPositions(ReferenceEngine):
    """Reports the same position twice: the runtime must count INV-2."""

    async def generate(
        self, session_key: str, history: Sequence[int], params: SamplingParams, options: Any = None
    ) -> AsyncIterator[Step]:
        async for step in super().generate(session_key, history, params):
            yield step
            yield step


@pytest.mark.parametrize(
    ("engine", "which"), [(LyingCache(), 1), (BackwardsPositions(), 2)], ids=["INV-1", "INV-2"]
)
async def test_invariant_violations_fail_the_session_and_are_counted(
    serve: Serve, engine: ReferenceEngine, which: int
) -> None:
    s = await serve(engine=engine)
    sid = await create(s.kakeya, [1, 2, 3])
    details = await expect_code(
        Code.FAILED_PRECONDITION,
        s.kakeya.Generate(kpb.GenerateRequest(session_id=sid, max_tokens=3, seed=1)),
    )
    assert "cache_invariant_violation" in details
    i = await info(s.kakeya, sid)
    assert (i.cache_invariant_inv1_violations, i.cache_invariant_inv2_violations) == (
        (1, 0) if which == 1 else (0, 1)
    )
    await expect_code(
        Code.NOT_FOUND,
        s.kakeya.AppendTokens(kpb.AppendTokensRequest(session_id=sid, token_ids=[1])),
    )
    assert (await events(s.runtime, sid))[-1].type == T.SESSION_ABORTED


# -- INV-3: bit-identical tokens however the history was built up -------------------


def make_engine(name: str) -> Any:
    if name == "reference":
        return ReferenceEngine()
    try:
        from sessiontape.engines.onnx import OnnxEngine
    except ImportError as exc:  # pragma: no cover - depends on the checkout
        pytest.skip(f"sessiontape.engines.onnx.OnnxEngine is not importable: {exc}")
    return OnnxEngine(size="tiny")


@pytest.fixture(params=["reference", "onnx"])
async def inv3(request: pytest.FixtureRequest, serve: Serve) -> tuple[Any, Any]:
    """A server on the named engine, and a second, cold instance of it as the oracle."""
    served = await serve(engine=make_engine(request.param))
    return served, make_engine(request.param)


_counter = iter(range(10**9))


async def cold(oracle: Any, history: Sequence[int], params: SamplingParams) -> list[int]:
    key = f"oracle-{next(_counter)}"
    try:
        return [
            st.token_id
            async for st in oracle.generate(key, list(history), params)
            if not st.is_prefill
        ]
    finally:
        oracle.forget(key)


def splits(draw: Any, n: int) -> list[tuple[int, int]]:
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, n - 1)), max_size=6)))) if n > 1 else []
    bounds = [0, *[c for c in cuts if 0 < c < n], n]
    return list(itertools.pairwise(bounds))


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
async def test_inv3_same_history_seed_and_params_give_identical_tokens(
    inv3: tuple[Any, Any], data: Any
) -> None:
    served, oracle = inv3
    stub = served.kakeya
    history = data.draw(st.lists(st.integers(0, 255), min_size=1, max_size=48), label="history")
    seed = data.draw(st.integers(0, U64_MAX), label="seed")
    temperature = data.draw(st.sampled_from([0.0, 0.7, 1.0, 1.3]), label="temperature")
    top_k = data.draw(st.sampled_from([0, 5]), label="top_k")
    max_tokens = data.draw(st.integers(1, 6), label="max_tokens")
    fields = {"seed": seed, "temperature": temperature, "top_k": top_k, "max_tokens": max_tokens}
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, seed=seed)

    whole = await create(stub, history)
    pieces = await create(stub)
    for a, b in splits(data.draw, len(history)):
        await stub.AppendTokens(kpb.AppendTokensRequest(session_id=pieces, token_ids=history[a:b]))
    one, _, _ = await run(stub, whole, **fields)
    many, _, _ = await run(stub, pieces, **fields)
    assert one == many == await cold(oracle, history, params)

    # a second turn on the warm session equals a cold run over the same history
    extra = data.draw(st.lists(st.integers(0, 255), max_size=8), label="extra")
    for a, b in splits(data.draw, len(extra)):
        await stub.AppendTokens(kpb.AppendTokensRequest(session_id=pieces, token_ids=extra[a:b]))
    warm, _, _ = await run(stub, pieces, **fields)
    assert warm == await cold(oracle, [*history, *many, *extra], params)


async def test_a_shutdown_while_the_server_waits_to_send_records_the_cancel_first(
    serve: Serve,
) -> None:
    """A client that stops reading leaves Generate waiting on HTTP/2 flow control to
    send; a shutdown then cancels the call inside grpc's send, not inside the
    servicer. The servicer's generator is still closed in the call's own task, so
    the generation's cancel is in the log when the server's stop returns (it was
    left to the interpreter's finalizer, after the drain, 2 runs in 8 under load)."""
    from tests.transports.grpc.tokensessions.conftest import TOKEN

    s = await serve(engine=ReferenceEngine(eos_bias=-1000.0, max_length=200_000))
    sid = await create(s.kakeya, [1, 2, 3])
    # no BDP probing: the stream's window stays 64 KiB, which a few thousand tokens fill
    async with grpc.aio.insecure_channel(s.address, options=[("grpc.http2.bdp_probe", 0)]) as ch:
        stub = kakeya_grpc.RuntimeServiceStub(ch)
        call = stub.Generate(
            kpb.GenerateRequest(session_id=sid, max_tokens=150_000, seed=1),
            metadata=(("authorization", f"Bearer {TOKEN}"),),
        )
        await call.read()  # the stream runs; the client reads nothing more
        last, still = -1, 0
        async with asyncio.timeout(60):
            while still < 5:  # the log stopped growing: the server is blocked sending
                await asyncio.sleep(0.1)
                now = await s.runtime.log.last_position()
                still = still + 1 if now == last else 0
                last = now
        await s.transport.stop(0.1)
        fins = await events(s.runtime, sid, T.GENERATION_FINISHED)
        assert [f.body["finish_reason"] for f in fins] == ["cancelled"]
        call.cancel()
