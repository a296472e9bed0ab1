"""The ONNX engine driven through sessiontape.core.runtime.Runtime, and contract checks shared with the reference engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from sessiontape.core.audit import audit_session
from sessiontape.core.engine.interface import Engine, OutputOptions, SamplingParams
from sessiontape.core.errors import InvalidImage
from sessiontape.core.events import T
from sessiontape.core.generation.request import GenerateRequest
from sessiontape.core.runtime import Runtime
from sessiontape.engines.onnx import OnnxEngine
from sessiontape.engines.reference import ReferenceEngine
from tests.helpers.config import make_config


@pytest.fixture
async def onnx_runtime(sqlite_url: str, tiny_dir: Path) -> AsyncIterator[Runtime]:
    rt = await Runtime.create(
        make_config(sqlite_url), engine=OnnxEngine(model_dir=tiny_dir, intra_op_threads=1)
    )
    try:
        yield rt
    finally:
        await rt.aclose()


async def test_sessions_record_the_binding_and_reexecute_bit_identically(
    onnx_runtime: Runtime,
) -> None:
    rt = onnx_runtime
    s = await rt.open_session("kakeya")
    await rt.append_text(s.session_id, "The tape remembers")
    for turn in range(3):
        evs = [
            e
            async for e in rt.generate(
                s.session_id,
                GenerateRequest(
                    SamplingParams(max_tokens=6, seed=turn, temperature=0.9),
                    OutputOptions(logprob_top_k=2),
                ),
            )
        ]
        assert evs[-1].type == T.GENERATION_FINISHED
        await rt.append_text(s.session_id, f" turn {turn}")
    opened = (await rt.log.read(s.session_id))[0]
    binding = opened.body["engine"]
    info = rt.engine.info
    assert binding["provider"] == info.provider and binding["model_hash"] == info.model_hash
    assert binding["runtime_version"] == info.runtime_version
    child = await rt.fork(s.session_id, at_position=10)
    [
        e
        async for e in rt.generate(
            child.session_id, GenerateRequest(SamplingParams(max_tokens=4, seed=7))
        )
    ]
    for sid in (s.session_id, child.session_id):
        report = await audit_session(rt, sid, reexecute=True)
        assert report.ok, report.to_json()
        assert report.generations >= 1


@pytest.fixture(params=["reference", "onnx"])
async def any_runtime(
    request: pytest.FixtureRequest, sqlite_url: str, tiny_dir: Path
) -> AsyncIterator[Runtime]:
    eng: Engine = (
        ReferenceEngine()
        if request.param == "reference"
        else OnnxEngine(model_dir=tiny_dir, intra_op_threads=1)
    )
    rt = await Runtime.create(make_config(sqlite_url), engine=eng)
    try:
        yield rt
    finally:
        await rt.aclose()


PENALIZED = SamplingParams(
    max_tokens=64,
    temperature=0.0,
    repetition_penalty=1.5,
    frequency_penalty=0.4,
    presence_penalty=0.2,
    penalty_last_n=48,
)


async def _tokens(rt: Runtime, sid: str, params: SamplingParams) -> list[int]:
    return [
        e.body["token"]
        async for e in rt.generate(sid, GenerateRequest(params))
        if e.type == T.GENERATION_TOKEN
    ]


async def test_penalties_are_recorded_and_reexecute_bit_identically(any_runtime: Runtime) -> None:
    """The penalties read only the tokens the generation produced: recorded in
    ``generation.started``, the generation re-executes to the same bits, and a fork
    at its start generates it again, on both engines; the prompt is not penalized."""
    rt = any_runtime
    s = await rt.open_session("kakeya")
    await rt.append_tokens(s.session_id, [5, 6, 7, 5, 6, 7, 5, 6])
    start = (await rt.get(s.session_id)).length
    penalized = await _tokens(rt, s.session_id, PENALIZED)
    started = [e for e in await rt.log.read(s.session_id) if e.type == T.GENERATION_STARTED]
    recorded = started[-1].body["params"]
    assert (recorded["repetition_penalty"], recorded["penalty_last_n"]) == (1.5, 48)
    assert (recorded["frequency_penalty"], recorded["presence_penalty"]) == (0.4, 0.2)
    report = await audit_session(rt, s.session_id, reexecute=True)
    assert report.reexecuted and report.ok, report.to_json()
    # a fork at the answer's start answers the same
    child = await rt.fork(s.session_id, at_position=start)
    assert await _tokens(rt, child.session_id, PENALIZED) == penalized
    plain = await rt.fork(s.session_id, at_position=start)
    unpenalized = await _tokens(rt, plain.session_id, SamplingParams(max_tokens=64, temperature=0))
    # the first token sees no generated token: the prompt's repeats change nothing
    assert unpenalized[0] == penalized[0]
    # then the penalties act
    assert unpenalized != penalized


async def test_images_are_rejected_for_the_text_only_model(onnx_runtime: Runtime) -> None:
    with pytest.raises(InvalidImage):
        onnx_runtime.engine.image_block_length(b"\x89PNG", "image/png")


@pytest.fixture(params=["reference", "onnx"])
def engine(request: pytest.FixtureRequest, tiny_dir: Path) -> Engine:
    if request.param == "reference":
        return ReferenceEngine()
    return OnnxEngine(model_dir=tiny_dir, intra_op_threads=1)


async def test_contract_prefill_only_yields_exactly_the_requested_positions(engine: Engine) -> None:
    hist = [int(t) for t in np.random.default_rng(0).integers(0, 256, 30)]
    opts = OutputOptions(logprob_ranges=((3, 6), (20, 22)), readout_ranges=((4, 5),))
    steps = [s async for s in engine.generate("k", hist, SamplingParams(max_tokens=0), opts)]
    assert [s.position for s in steps] == [3, 4, 5, 20, 21]
    assert all(s.is_prefill and s.token_id == hist[s.position] for s in steps)
    assert [s.readout is not None for s in steps] == [False, True, False, False, False]


async def test_contract_stop_ids_stop_after_yielding(engine: Engine) -> None:
    hist = list(b"stop here")
    free = [
        s async for s in engine.generate("a", hist, SamplingParams(max_tokens=6, temperature=0))
    ]
    stop = free[1].token_id
    got = [
        s
        async for s in engine.generate(
            "b", hist, SamplingParams(max_tokens=6, temperature=0, stop_token_ids=(stop,))
        )
    ]
    assert got[-1].token_id == stop and len(got) <= 2
    assert [s.position for s in got] == list(range(len(hist), len(hist) + len(got)))


async def test_contract_same_seed_same_tokens(engine: Engine) -> None:
    hist = list(b"seeded")
    p = SamplingParams(max_tokens=8, temperature=1.0, seed=42)
    a = [s async for s in engine.generate("a", hist, p)]
    b = [s async for s in engine.generate("b", hist, p)]
    assert a == b


async def test_kv_bytes_gauge_follows_the_engine_caches(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from sessiontape.core import metrics
    from sessiontape.core.engine.interface import SamplingParams
    from sessiontape.core.runtime import Runtime
    from sessiontape.engines.onnx import OnnxEngine
    from tests.helpers.config import make_config

    engine = OnnxEngine(size="tiny")
    rt = await Runtime.create(
        make_config(f"sqlite+aiosqlite:///{tmp_path / 'kv.db'}"), engine=engine
    )
    try:
        sid = (await rt.open_session("t")).session_id
        await rt.append_text(sid, "Hello there")
        async for _ in rt.generate(sid, GenerateRequest(SamplingParams(max_tokens=4, seed=1))):
            pass
        live = engine.kv_live_bytes(sid)
        assert live > 0
        assert engine.kv_total_bytes() >= live
        assert metrics.KV_BYTES._value.get() == engine.kv_total_bytes()
    finally:
        await rt.aclose()


async def test_generations_through_the_runtime_share_the_engines_passes(
    onnx_runtime: Runtime,
) -> None:
    """A batching engine is not fed one generation at a time through the priority gate."""
    import asyncio

    rt = onnx_runtime
    eng = rt.engine
    assert isinstance(eng, OnnxEngine)
    if not eng.batches:
        pytest.skip(
            "this provider runs the fixed pass shape, which the batch scheduler does not serve"
        )
    sids = []
    for i in range(4):
        s = await rt.open_session("kakeya", eos_token_ids=[])
        await rt.append_tokens(
            s.session_id, [int(t) for t in np.random.default_rng(i).integers(3, 250, 9)]
        )
        sids.append(s.session_id)
    before = eng.scheduler_stats()

    async def one(sid: str, seed: int) -> list[int]:
        return [
            e.body["token"]
            async for e in rt.generate(
                sid, GenerateRequest(SamplingParams(max_tokens=40, seed=seed, temperature=0.9))
            )
            if e.type == T.GENERATION_TOKEN
        ]

    outs = await asyncio.gather(*(one(sid, i) for i, sid in enumerate(sids)))
    after = eng.scheduler_stats()
    assert all(len(o) == 40 for o in outs)
    passes = after["passes"] - before["passes"]
    # four sessions of 40 tokens: far fewer passes than tokens when they share them
    assert passes <= 0.4 * 160, passes
    for sid in sids:
        report = await audit_session(rt, sid, reexecute=True)
        assert report.ok, report.to_json()
