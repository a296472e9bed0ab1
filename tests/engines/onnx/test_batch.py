"""Continuous batching (engines/onnx/batch.py): many sessions, one pass, the same bits.

A session's tokens, logprobs, top logprobs and readouts must not depend on
whether it decoded alone, beside 1, 3 or 7 other sessions, or on the
single-session path (``batch_slots=0``); sessions join and leave between
passes, a cancelled or failed one leaves without disturbing the others, and a
full pool makes newcomers wait (then ``EngineBusy``) instead of evicting.
Runs on the provider the engine picks (the batch scheduler serves the growing
static layout; where the fixed CUDA shape is chosen these tests skip).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from sessiontape.core.engine.interface import OutputOptions, SamplingParams, Step
from sessiontape.core.errors import EngineBusy, EngineError
from sessiontape.engines.onnx.engine import OnnxEngine
from tests.helpers.engines import failing_once


def history(seed_: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed_).integers(0, 256, n)]


def batching_engine(model_dir: Path, **kw: Any) -> OnnxEngine:
    eng = OnnxEngine(model_dir=model_dir, intra_op_threads=1, **kw)
    if eng._batch is None and kw.get("batch_slots", 1):
        pytest.skip(
            "this provider runs the fixed pass shape, which the batch scheduler does not serve"
        )
    return eng


async def run(
    eng: OnnxEngine,
    key: str,
    hist: Sequence[int],
    params: SamplingParams,
    options: OutputOptions | None = None,
    stop_after: int | None = None,
    delay: float = 0.0,
) -> list[Step]:
    if delay:
        await asyncio.sleep(delay)
    gen = cast(
        AsyncGenerator[Step, None],
        eng.generate(key, list(hist), params, options or OutputOptions()),
    )
    got: list[Step] = []
    try:
        async for step in gen:
            got.append(step)
            if stop_after is not None and len(got) >= stop_after:
                break
    finally:
        await gen.aclose()
    return got


SESSIONS = [
    # history seed, length, sampling
    (1, 23, SamplingParams(max_tokens=20, temperature=0.0)),
    (2, 9, SamplingParams(max_tokens=17, temperature=0.9, seed=11, top_k=20)),
    (3, 40, SamplingParams(max_tokens=12, temperature=1.3, seed=12, top_p=0.8, min_p=0.05)),
    (4, 5, SamplingParams(max_tokens=25, temperature=0.7, seed=13, repetition_penalty=1.3)),
    (
        5,
        31,
        SamplingParams(
            max_tokens=8,
            temperature=0.0,
            stop_token_ids=(7, 9),
            frequency_penalty=0.7,
            presence_penalty=0.3,
            penalty_last_n=-1,
        ),
    ),
    (6, 14, SamplingParams(max_tokens=19, temperature=1.0, seed=14)),
    (7, 2, SamplingParams(max_tokens=22, temperature=0.5, seed=15)),
    (8, 60, SamplingParams(max_tokens=15, temperature=1.1, seed=16, top_k=5)),
]
#: session 0 also asks for top logprobs and readouts of some generated positions
OPTIONS = OutputOptions(logprob_top_k=3, readout_ranges=((25, 30),))


async def test_a_session_decodes_the_same_bits_alone_beside_1_3_and_7_others_and_unbatched(
    tiny_dir: Path,
) -> None:
    solo = batching_engine(tiny_dir, batch_slots=0)
    sid, n, params = SESSIONS[0]
    ref = await run(solo, "x", history(sid, n), params, OPTIONS)
    assert len(ref) == 20 and any(s.readout is not None for s in ref)
    eng = batching_engine(tiny_dir, batch_slots=8)
    for neighbours in (0, 1, 3, 7):
        eng.forget("x")
        others = [
            run(eng, f"n{i}", history(s, m), p)
            for i, (s, m, p) in enumerate(SESSIONS[1 : 1 + neighbours])
        ]
        got, *rest = await asyncio.gather(run(eng, "x", history(sid, n), params, OPTIONS), *others)
        assert got == ref, f"beside {neighbours} others"
        # and every neighbour decoded what it decodes alone
        for (s, m, p), out in zip(SESSIONS[1 : 1 + neighbours], rest, strict=True):
            assert out == await run(solo, "alone", history(s, m), p)
    # the neighbours really shared passes with it
    assert eng.scheduler_stats()["shared_passes"] > 10


async def test_history_built_up_in_turns_beside_neighbours_equals_one_shot_alone(
    tiny_dir: Path,
) -> None:
    """Cached turns and a fork, each turn decoded beside other sessions."""
    solo = batching_engine(tiny_dir, batch_slots=0)
    hist = history(21, 12)
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=3)
    one = await run(solo, "one", hist, SamplingParams(max_tokens=30, temperature=0.8, seed=3))
    eng = batching_engine(tiny_dir, batch_slots=4)
    noise = [run(eng, f"z{i}", history(30 + i, 7 + i), SESSIONS[i][2]) for i in range(3)]
    first, *_ = await asyncio.gather(run(eng, "t", hist, params), *noise)
    grown = hist + [s.token_id for s in first]
    # the seeded sampler draws by position, so a continuation with the same seed matches
    second, *_ = await asyncio.gather(
        run(eng, "t", grown, params),
        *[run(eng, f"y{i}", history(40 + i, 9), SESSIONS[i][2]) for i in range(2)],
    )
    eng.fork("t", "t2", len(grown))
    third = await run(eng, "t2", grown + [s.token_id for s in second], params)
    assert [s.token_id for s in first + second + third] == [s.token_id for s in one]
    assert [s.logprob for s in first + second + third] == [s.logprob for s in one]


async def test_a_cancelled_session_leaves_the_batch_without_disturbing_the_others(
    tiny_dir: Path,
) -> None:
    eng = batching_engine(tiny_dir, batch_slots=8)
    solo = batching_engine(tiny_dir, batch_slots=0)
    refs = [await run(solo, "r", history(s, m), p) for s, m, p in SESSIONS[:4]]
    outs = await asyncio.gather(
        *[
            run(eng, f"c{i}", history(s, m), p, stop_after=3 if i == 1 else None)
            for i, (s, m, p) in enumerate(SESSIONS[:4])
        ]
    )
    assert outs[1] == refs[1][:3]
    assert [o for i, o in enumerate(outs) if i != 1] == [r for i, r in enumerate(refs) if i != 1]
    # the cancelled session's cache holds only what it yielded, and continues exactly
    entry = eng.cache.get("c1")
    s, m, p = SESSIONS[1]
    assert entry is not None and entry.users == 0
    assert entry.tokens == (history(s, m) + [x.token_id for x in outs[1]])[: len(entry.tokens)]
    rest = await run(
        eng,
        "c1",
        history(s, m) + [x.token_id for x in outs[1]],
        SamplingParams(
            max_tokens=p.max_tokens - 3, temperature=p.temperature, seed=p.seed, top_k=p.top_k
        ),
    )
    assert outs[1] + rest == refs[1]
    stats = eng.scheduler_stats()
    assert stats["slots_in_use"] == 0 and stats["queue"] == 0


async def test_a_full_pool_makes_new_sessions_wait_then_answers_engine_busy(tiny_dir: Path) -> None:
    eng = batching_engine(tiny_dir, batch_slots=2)
    solo = batching_engine(tiny_dir, batch_slots=0)
    # three sessions, two slots: the third waits for a slot and then decodes the same bits
    outs = await asyncio.gather(
        *[run(eng, f"w{i}", history(s, m), p) for i, (s, m, p) in enumerate(SESSIONS[:3])]
    )
    for (s, m, p), out in zip(SESSIONS[:3], outs, strict=True):
        assert out == await run(solo, "r", history(s, m), p)

    # a slow consumer holds its slot; with no wait allowed the newcomer gets the typed error
    busy = batching_engine(tiny_dir, batch_slots=1, batch_wait_s=0.05)
    hist = history(50, 10)
    gen = cast(
        AsyncGenerator[Step, None],
        busy.generate("hold", hist, SamplingParams(max_tokens=500, temperature=0)),
    )
    await anext(gen)  # admitted: it holds the only slot while it is not consumed
    with pytest.raises(EngineBusy, match="KV slots"):
        await run(busy, "late", history(51, 10), SamplingParams(max_tokens=5, temperature=0))
    assert busy.scheduler_stats()["queue"] == 0
    await gen.aclose()
    # the slot came back: the newcomer runs now
    assert len(await run(busy, "late", history(51, 10), SamplingParams(max_tokens=5))) == 5
    late = busy.cache.get("late")
    assert late is not None and late.users == 0


async def test_a_failed_pass_fails_its_sessions_and_the_next_ones_run(tiny_dir: Path) -> None:
    eng = batching_engine(tiny_dir, batch_slots=4)
    assert eng._batch is not None
    with failing_once(eng._batch, "_pass", 3, RuntimeError("injected")):
        results = await asyncio.gather(
            *[run(eng, f"f{i}", history(s, m), p) for i, (s, m, p) in enumerate(SESSIONS[:3])],
            return_exceptions=True,
        )
    assert any(isinstance(r, EngineError) and "injected" in str(r) for r in results)
    solo = batching_engine(tiny_dir, batch_slots=0)
    s, m, p = SESSIONS[0]
    assert await run(eng, "f0", history(s, m), p) == await run(solo, "r", history(s, m), p)
    assert eng.scheduler_stats()["slots_in_use"] == 0


async def test_a_long_prompt_does_not_stall_the_others_decode(tiny_dir: Path) -> None:
    """Prefill runs a chunk at a time between decode passes (batch_prefill_share=1)."""
    eng = batching_engine(tiny_dir, batch_slots=4, prefill_chunk=16)
    order: list[str] = []

    async def watch(key: str, hist: list[int], params: SamplingParams) -> None:
        async for _ in eng.generate(key, hist, params):
            order.append(key)

    fast = watch("decoder", history(60, 4), SamplingParams(max_tokens=40, temperature=0))
    slow = watch("prompt", history(61, 1500), SamplingParams(max_tokens=1, temperature=0))
    await asyncio.gather(fast, slow)
    # the decoder's 40 tokens all came while the long prompt's 94 chunks ran, a chunk per pass
    assert order == ["decoder"] * 40 + ["prompt"]


@seed(20261123)
@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    plan=st.lists(
        st.tuples(
            st.integers(0, 7),  # which session
            st.integers(0, 30),  # arrival delay, ms
            st.one_of(st.none(), st.integers(1, 12)),  # cancel after this many steps
        ),
        min_size=1,
        max_size=6,
    ),
    slots=st.integers(1, 8),
)
def test_random_arrivals_lengths_and_cancellations_keep_every_sessions_bits(
    tiny_dir: Path,
    solo_refs: dict[int, list[Step]],
    plan: list[tuple[int, int, int | None]],
    slots: int,
) -> None:
    async def main() -> None:
        eng = batching_engine(tiny_dir, batch_slots=slots, batch_wait_s=60)
        try:
            outs = await asyncio.gather(
                *[
                    run(
                        eng,
                        f"p{k}",
                        history(SESSIONS[i][0], SESSIONS[i][1]),
                        SESSIONS[i][2],
                        stop_after=stop,
                        delay=d / 1000,
                    )
                    for k, (i, d, stop) in enumerate(plan)
                ]
            )
            for (i, _, stop), out in zip(plan, outs, strict=True):
                ref = solo_refs[i]
                assert out == (ref if stop is None else ref[:stop])
            stats = eng.scheduler_stats()
            assert stats["slots_in_use"] == 0 and stats["queue"] == 0
        finally:
            await eng.aclose()

    asyncio.run(main())


@pytest.fixture(scope="module")
def solo_refs(tiny_dir: Path) -> dict[int, list[Step]]:
    async def main() -> dict[int, list[Step]]:
        solo = OnnxEngine(model_dir=tiny_dir, intra_op_threads=1, batch_slots=0)
        return {i: await run(solo, "r", history(s, m), p) for i, (s, m, p) in enumerate(SESSIONS)}

    return asyncio.run(main())


async def test_the_scheduler_reports_slots_queue_and_occupancy(tiny_dir: Path) -> None:
    eng = batching_engine(tiny_dir, batch_slots=4)
    seen: list[dict[str, float]] = []

    async def sample() -> None:
        for _ in range(200):
            seen.append(eng.scheduler_stats())
            await asyncio.sleep(0.001)

    sampler = asyncio.create_task(sample())
    await asyncio.gather(
        *[run(eng, f"m{i}", history(s, m), p) for i, (s, m, p) in enumerate(SESSIONS[:4])]
    )
    sampler.cancel()
    assert max(s["slots_in_use"] for s in seen) >= 2
    assert 0 < eng.scheduler_stats()["pass_occupancy"] <= 1
    assert eng.kv_total_bytes() >= eng.scheduler_stats()["pool_bytes"] > 0
    assert eng.info.extra["batch_slots"] == 4


async def test_metrics_show_the_schedulers_gauges(tiny_dir: Path) -> None:
    from prometheus_client import generate_latest

    from sessiontape.core import metrics

    eng = batching_engine(tiny_dir, batch_slots=3)
    metrics.watch_engine(eng.scheduler_stats)
    await run(eng, "g", history(70, 8), SamplingParams(max_tokens=6, temperature=0))
    text = generate_latest().decode()
    assert "sessiontape_engine_batch_slots 3.0" in text
    assert "sessiontape_engine_batch_slots_in_use 0.0" in text
    assert "sessiontape_engine_batch_queue 0.0" in text
    passes = [ln for ln in text.splitlines() if ln.startswith("sessiontape_engine_batch_passes ")]
    assert passes and float(passes[0].split()[1]) >= 5


def test_every_wire_answers_engine_busy_as_retryable_resource_exhaustion() -> None:
    import grpc

    from sessiontape.transports.grpc.status import code_for
    from sessiontape.transports.http.server.errors import to_response

    exc = EngineBusy("all 8 KV slots are held by generating sessions (waited 30 s)")
    resp = to_response(exc)
    assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
    assert b'"engine_busy"' in resp.body
    assert code_for(exc) == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_a_fault_in_the_scheduler_ends_its_sessions_with_an_error_not_a_hang(
    tiny_dir: Path,
) -> None:
    eng = batching_engine(tiny_dir, batch_slots=4)
    assert eng._batch is not None
    with failing_once(eng._batch, "_finish_row", 5, IndexError("a bug")):
        results = await asyncio.wait_for(
            asyncio.gather(
                *[run(eng, f"x{i}", history(s, m), p) for i, (s, m, p) in enumerate(SESSIONS[:3])],
                return_exceptions=True,
            ),
            timeout=30,
        )
    assert any(isinstance(r, EngineError) for r in results)
    s, m, p = SESSIONS[0]
    assert len(await run(eng, "after", history(s, m), p)) == 20
