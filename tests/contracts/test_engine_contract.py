"""The engine contract: written once against sessiontape.core.engine's ABC, run on every engine present.

Engines: the reference engine, and the ONNX engine on the tiny demo model
with its provider's default pass shape and with one fixed pass shape (the
CUDA scheme), on the CPU provider and, where onnxruntime offers it, on CUDA;
the reference and CPU ONNX engines also served from a worker process
(core/engine/worker.py).
"Cold" below always means a fresh engine instance given the whole history in
one call; every other way of reaching the same history (warm cache, fork,
forget, cancel and continue, rewind) must yield identical steps: the same
tokens, positions, logprobs and top-k, bit for bit (Kakeya INV-3).
"""

from __future__ import annotations

import random
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

import pytest

from sessiontape.core.engine.interface import Engine, OutputOptions, SamplingParams, Step

Factory = Callable[[], Engine]

OPTIONS = OutputOptions(logprob_top_k=3, logprob_ranges=((2, 5),))
SAMPLED = SamplingParams(max_tokens=10, temperature=0.9, top_k=40, top_p=0.95, seed=1234)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sessiontape.engines.onnx.demo import build_demo

    folder = tmp_path_factory.mktemp("tiny")
    build_demo("tiny", folder)
    return folder


@pytest.fixture(
    params=[
        "reference",
        "onnx-cpu",
        "onnx-cpu-fixed",
        "onnx-cuda",
        "reference-worker",
        "onnx-cpu-worker",
    ]
)
async def make_engine(request: pytest.FixtureRequest, demo_dir: Path) -> AsyncIterator[Factory]:
    """A factory of fresh engines of one kind; every engine it made is closed after the test.

    ``onnx-cuda`` skips with a reason where the CUDA provider does not load."""
    made: list[Engine] = []

    def factory() -> Engine:
        kind = request.param
        eng: Engine
        if kind.endswith("-worker"):  # the same engines served from a worker process
            from sessiontape.core.engine.worker import WorkerEngine

            if kind == "reference-worker":
                eng = WorkerEngine("reference")
            else:
                eng = WorkerEngine(
                    "onnx",
                    {
                        "model_dir": str(demo_dir),
                        "intra_op_threads": 1,
                        "providers": "CPUExecutionProvider",
                    },
                )
        elif kind == "reference":
            from sessiontape.engines.reference import ReferenceEngine

            eng = ReferenceEngine()
        else:
            from sessiontape.engines.onnx import OnnxEngine

            if kind == "onnx-cuda":  # what "auto" picks on a GPU: fixed shapes, CUDA graphs
                eng = OnnxEngine(model_dir=demo_dir, providers="auto")
            else:
                kw: dict[str, Any] = {
                    "model_dir": demo_dir,
                    "intra_op_threads": 1,
                    "providers": "CPUExecutionProvider",
                }
                if kind == "onnx-cpu-fixed":
                    kw["pass_rows"] = 4  # fixed shape: 4 rows over a full-length buffer
                eng = OnnxEngine(**kw)
        made.append(eng)
        return eng

    if request.param == "onnx-cuda" and factory().info.provider != "CUDAExecutionProvider":
        pytest.skip(
            "the CUDA provider does not load here (no onnxruntime-gpu, GPU or CUDA libraries)"
        )
    yield factory
    for eng in made:
        await eng.aclose()


def history(seed: int, n: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(32, 127) for _ in range(n)]


async def run(
    eng: Engine,
    key: str,
    hist: list[int],
    params: SamplingParams = SAMPLED,
    options: OutputOptions = OPTIONS,
) -> list[Step]:
    return [s async for s in eng.generate(key, hist, params, options)]


def generated(steps: list[Step]) -> list[int]:
    return [s.token_id for s in steps if not s.is_prefill]


async def cold(
    make: Factory,
    hist: list[int],
    params: SamplingParams = SAMPLED,
    options: OutputOptions = OPTIONS,
) -> list[Step]:
    return await run(make(), "cold", hist, params, options)


async def test_info_and_tokenizer_round_trip(make_engine: Factory) -> None:
    eng = make_engine()
    info = eng.info
    assert info.vocab_size > 0 and info.max_length > 0 and info.eos_token_ids
    assert all(0 <= t < info.vocab_size for t in info.eos_token_ids)
    ids = eng.tokenize("hello, world")
    assert ids and all(0 <= t < info.vocab_size for t in ids)
    assert eng.detokenize(ids) == "hello, world"


@pytest.mark.parametrize("params", [SAMPLED, GREEDY], ids=["sampled", "greedy"])
async def test_determinism_same_inputs_same_steps(
    make_engine: Factory, params: SamplingParams
) -> None:
    hist = history(1, 24)
    eng = make_engine()
    first = await run(eng, "a", hist, params)
    assert (
        len(generated(first)) == params.max_tokens or generated(first)[-1] in eng.info.eos_token_ids
    )
    assert [s.position for s in first if s.is_prefill] == [
        2,
        3,
        4,
    ]  # the asked prompt range, scored
    for s in first:
        assert s.logprob is not None and s.logprob <= 0.0 and len(s.top_logprobs) == 3
    # another key on the same engine, and a fresh engine: identical, logprobs included
    assert await run(eng, "b", hist, params) == first
    assert await cold(make_engine, hist, params) == first
    # a different seed changes a sampled generation (the seed is not ignored)
    if params.temperature:
        other = SamplingParams(**{**params.__dict__, "seed": 99})
        assert generated(await run(eng, "c", hist, other)) != generated(first)


async def test_cache_reuse_warm_second_turn_equals_cold(make_engine: Factory) -> None:
    eng = make_engine()
    hist = history(2, 30)
    turn1 = await run(eng, "s", hist)
    turn2_hist = hist + generated(turn1) + history(3, 7)
    warm = await run(eng, "s", turn2_hist)
    assert warm == await cold(make_engine, turn2_hist)
    # a third turn on top of the warm second one, too
    turn3_hist = turn2_hist + generated(warm)
    assert await run(eng, "s", turn3_hist, GREEDY) == await cold(make_engine, turn3_hist, GREEDY)


async def test_forget_then_generate_equals_cold(make_engine: Factory) -> None:
    eng = make_engine()
    hist = history(4, 20)
    first = await run(eng, "f", hist)
    eng.forget("f")
    assert not eng.cached_length("f")
    assert eng.kv_live_bytes("f") == 0
    again_hist = hist + generated(first)
    assert await run(eng, "f", again_hist) == await cold(make_engine, again_hist)
    eng.forget("never-seen")  # forgetting an unknown key is harmless


async def test_fork_mid_response_then_generate_equals_cold(make_engine: Factory) -> None:
    eng = make_engine()
    hist = history(5, 20)
    parent_steps = await run(eng, "parent", hist)
    parent_tokens = hist + generated(parent_steps)
    at = len(hist) + 4  # inside the response
    eng.fork("parent", "child", at)
    child_hist = parent_tokens[:at] + history(6, 3)
    child = await run(eng, "child", child_hist)
    assert child == await cold(make_engine, child_hist)
    # the parent is untouched: its next turn still equals its own cold run
    nxt = parent_tokens + history(7, 2)
    assert await run(eng, "parent", nxt) == await cold(make_engine, nxt)
    # a fork continued with the parent's own tokens yields what the parent yielded
    eng.fork("parent", "twin", at)
    twin = await run(
        eng,
        "twin",
        parent_tokens[:at],
        SamplingParams(**{**SAMPLED.__dict__, "max_tokens": 6}),
        OutputOptions(),
    )
    assert generated(twin) == generated(parent_steps)[4:10]


@pytest.mark.parametrize("stop_at", [1, 4, 9])
async def test_cancel_at_step_k_then_continue_equals_uninterrupted(
    make_engine: Factory, stop_at: int
) -> None:
    hist = history(8, 16)
    full = await cold(make_engine, hist, SAMPLED, OutputOptions(logprob_top_k=2))
    eng = make_engine()
    gen = cast(
        AsyncGenerator[Step, None], eng.generate("c", hist, SAMPLED, OutputOptions(logprob_top_k=2))
    )
    got: list[Step] = []
    async for step in gen:
        got.append(step)
        if len(got) == stop_at:
            break
    await gen.aclose()
    assert got == full[:stop_at]
    rest_params = SamplingParams(**{**SAMPLED.__dict__, "max_tokens": SAMPLED.max_tokens - stop_at})
    rest = await run(eng, "c", hist + generated(got), rest_params, OutputOptions(logprob_top_k=2))
    assert got + rest == full


@pytest.mark.parametrize("keep", [0, 5, 20, 26])
async def test_rewind_then_generate_equals_cold(make_engine: Factory, keep: int) -> None:
    eng = make_engine()
    hist = history(9, 20)
    whole = hist + generated(await run(eng, "r", hist))
    eng.rewind("r", keep)
    cached = eng.cached_length("r")
    assert cached is None or cached <= keep
    again = whole[:keep] + history(10, 3)
    assert await run(eng, "r", again) == await cold(make_engine, again)
