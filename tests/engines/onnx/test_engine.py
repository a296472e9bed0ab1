"""The ONNX Runtime engine against a real onnxruntime session on the tiny demo model."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sessiontape.core.engine.interface import OutputOptions, SamplingParams, Step
from sessiontape.core.errors import ConfigError, ContextOverflow, EngineError, InvalidParameters
from sessiontape.engines.onnx import OnnxEngine
from sessiontape.engines.onnx.demo import EOS, SIZES, build_demo
from sessiontape.engines.onnx.model import infer_graph
from sessiontape.engines.onnx.runner import quiet_ort
from sessiontape.engines.sampling import log_softmax
from tests.helpers.engines import alone_only, failing_once
from tests.helpers.onnx import collect, history


def prefill_only() -> SamplingParams:
    return SamplingParams(max_tokens=0)


def raw_prefill(model_dir: Path, tokens: Sequence[int]) -> dict[str, Any]:
    """One full prefill through a plain onnxruntime session on the CPU: the oracle."""
    ort = quiet_ort()
    sess = ort.InferenceSession(str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    spec = infer_graph(sess.get_inputs(), sess.get_outputs())
    n = len(tokens)
    past = (
        -(-n // 64) * 64 if spec.static else 0
    )  # a static buffer (slots in blocks of 64), or an empty cache
    feeds: dict[str, Any] = {
        "input_ids": np.asarray([tokens], np.int64),
        "attention_mask": np.ones((1, past or n), np.int64),
        "position_ids": np.arange(n, dtype=np.int64)[None],
    }
    for i in range(spec.layers):
        for k in ("key", "value"):
            feeds[f"past_key_values.{i}.{k}"] = np.zeros(
                (1, spec.kv_heads, past, spec.head_dim), np.float32
            )
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds), strict=True))


def on_cpu(engine: OnnxEngine) -> bool:
    return engine.info.provider == "CPUExecutionProvider"


def agrees(engine: OnnxEngine, got: float, want: float) -> bool:
    """The CPU oracle's number: bit for bit on the CPU, to TF32 rounding on another provider
    (cuBLAS multiplies float32 in TF32 by default, and its kernels sum in another order;
    bit-exactness there is warm vs cold, tested below)."""
    return got == want if on_cpu(engine) else bool(np.isclose(got, want, rtol=1e-2, atol=1e-2))


# -- the model -------------------------------------------------------------


def test_graph_io_is_inferred(onnx_engine: OnnxEngine) -> None:
    spec, tiny = onnx_engine.spec, SIZES["tiny"]
    assert (spec.layers, spec.kv_heads, spec.head_dim) == (
        tiny.layers,
        tiny.kv_heads,
        tiny.head_dim,
    )
    assert spec.vocab_size == tiny.vocab and spec.hidden_size == tiny.hidden
    assert spec.hidden_layers == tuple(range(tiny.layers + 1))
    info = onnx_engine.info
    assert info.provider in onnx_engine._sess.get_providers() and info.runtime_version
    assert info.eos_token_ids == (EOS,) and info.image_block_tokens is None
    assert info.readout_manifest is not None and info.readout_manifest.layers == (1, 2)


def test_demo_build_is_deterministic(tiny_dir: Path, tmp_path: Path) -> None:
    again = build_demo("tiny", tmp_path)
    assert again.read_bytes() == (tiny_dir / "model.onnx").read_bytes()
    cfg = json.loads((tmp_path / "genai_config.json").read_text())
    assert cfg["model"]["decoder"]["num_hidden_layers"] == SIZES["tiny"].layers


def test_model_without_the_convention_is_rejected(tmp_path: Path) -> None:
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])
    y = helper.make_tensor_value_info("logits", TensorProto.INT64, ["b", "s"])
    graph = helper.make_graph(
        [helper.make_node("Identity", ["input_ids"], ["logits"])], "g", [x], [y]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    (tmp_path / "model.onnx").write_bytes(model.SerializeToString())
    with pytest.raises(EngineError, match="attention_mask"):
        OnnxEngine(model_dir=tmp_path)


def test_session_options_are_applied_and_reported(tiny_dir: Path) -> None:
    eng = OnnxEngine(model_dir=tiny_dir, intra_op_threads=1, spinning=True)
    opts = eng._sess.get_session_options()
    assert opts.intra_op_num_threads == 1
    assert opts.get_session_config_entry("session.intra_op.allow_spinning") == "1"
    # spinning stops when a pass returns (the loop and the log get the CPU between passes)
    assert opts.get_session_config_entry("session.force_spinning_stop") == "1"
    default = OnnxEngine(model_dir=tiny_dir)
    assert (
        default._sess.get_session_options().get_session_config_entry(
            "session.intra_op.allow_spinning"
        )
        == "0"
    )
    extra = default.info.extra
    assert (extra["spinning"], extra["lookahead"]) == (False, True)
    # the CPU's passes carry 2.. rows; CUDA's default is one fixed shape of 16 rows
    assert extra["min_rows"] == (2 if on_cpu(default) else extra["pass_rows"])


def test_bad_options_are_config_errors(tiny_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        OnnxEngine(model_dir=tiny_dir, no_such_option=1)
    with pytest.raises(ConfigError):
        OnnxEngine(size="huge")
    with pytest.raises(ConfigError):
        OnnxEngine(model_dir=tmp_path)
    with pytest.raises(ConfigError):
        OnnxEngine(model_dir=tiny_dir, max_length=10**9)
    with pytest.raises(EngineError):
        OnnxEngine(model_dir=tiny_dir, providers=["NoSuchExecutionProvider"])
    bads: list[dict[str, Any]] = [
        {"decode_batch": 0},
        {"min_rows": 0},
        {"prefill_chunk": 0},
        {"workers": 0},
        {"batch_slots": -1},
        {"batch_slots": 10**9},
        {"batch_slots": "8"},
        {"batch_slots": True},
        {"batch_prefill_share": 0},
        {"batch_prefill_share": 1.5},
        {"batch_wait_s": -1},
        {"batch_wait_s": float("nan")},
        {"batch_wait_s": float("inf")},
        {"batch_wait_s": "30"},
        {"batch_slots": 4, "pass_rows": 4},  # the fixed shape does not batch (yet)
    ]
    for bad in bads:
        with pytest.raises(ConfigError):
            OnnxEngine(model_dir=tiny_dir, **bad)


# -- results match a plain onnxruntime prefill ------------------------------


async def test_prompt_logprobs_prefill_only(onnx_engine: OnnxEngine, tiny_dir: Path) -> None:
    hist = history(1, 40)
    opts = OutputOptions(logprob_top_k=2, logprob_ranges=((0, 3), (30, 33)))
    steps = await collect(onnx_engine, "s", hist, prefill_only(), opts)
    assert [s.position for s in steps] == [0, 1, 2, 30, 31, 32]
    assert all(s.is_prefill and s.token_id == hist[s.position] for s in steps)
    assert steps[0].logprob is None  # nothing predicts the first token
    logits = raw_prefill(tiny_dir, hist)["logits"][0]
    for s in steps[1:]:
        lp = log_softmax(logits[s.position - 1])
        assert s.logprob is not None and agrees(onnx_engine, s.logprob, float(lp[hist[s.position]]))
        assert agrees(onnx_engine, s.top_logprobs[0][1], float(lp.max()))


async def test_readouts_are_concept_cosines(onnx_engine: OnnxEngine, tiny_dir: Path) -> None:
    hist = history(2, 25)
    steps = await collect(
        onnx_engine,
        "s",
        hist,
        SamplingParams(max_tokens=2, temperature=0),
        OutputOptions(readout_ranges=((5, 7), (25, 27))),
    )
    by_pos = {s.position: s for s in steps}
    assert sorted(p for p, s in by_pos.items() if s.readout is not None) == [5, 6, 25, 26]
    manifest = onnx_engine.info.readout_manifest
    assert manifest is not None
    full = raw_prefill(tiny_dir, [*hist, by_pos[25].token_id, by_pos[26].token_id])
    concepts = json.loads((tiny_dir / "readout_concepts.json").read_text())
    for p in (5, 6, 25, 26):
        want = []
        for li, layer in enumerate(manifest.layers):
            h = full[f"hidden_states.{layer}"][0, p].astype(np.float64)
            d = np.asarray(concepts["directions"][li], np.float64)
            d = d / np.linalg.norm(d, axis=1, keepdims=True)
            want.extend(d @ h / np.linalg.norm(h))
        got = by_pos[p].readout
        assert got is not None and len(got) == len(manifest.layers) * len(manifest.concepts)
        assert np.allclose(got, want, rtol=0, atol=1e-12 if on_cpu(onnx_engine) else 1e-2)


async def test_custom_readout_concepts(tiny_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(
        json.dumps({"concepts": ["x"], "layers": [0], "directions": [[[1.0] + [0.0] * 63]]})
    )
    eng = OnnxEngine(model_dir=tiny_dir, readout_concepts=path, intra_op_threads=1)
    assert eng.info.readout_manifest is not None and eng.info.readout_manifest.concepts == ("x",)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"concepts": ["x"], "layers": [7], "directions": [[[1.0] * 64]]}))
    with pytest.raises(ConfigError, match="layers"):
        OnnxEngine(model_dir=tiny_dir, readout_concepts=bad)


async def test_greedy_matches_onnxruntime_genai(onnx_engine: OnnxEngine, tiny_dir: Path) -> None:
    og = pytest.importorskip("onnxruntime_genai")
    prompt = list(b"Hello")
    ours = [
        s.token_id
        for s in await collect(
            onnx_engine,
            "g",
            prompt,
            SamplingParams(max_tokens=20, temperature=0, stop_token_ids=(EOS,)),
        )
    ]
    model = og.Model(str(tiny_dir))
    gp = og.GeneratorParams(model)
    gp.set_search_options(
        max_length=64, do_sample=False
    )  # the static buffer's slots come in blocks of 64
    gen = og.Generator(model, gp)
    gen.append_tokens(prompt)
    theirs: list[int] = []
    while not gen.is_done():
        gen.generate_next_token()
        theirs.append(int(gen.get_next_tokens()[0]))
    assert ours == theirs[: len(ours)] and len(ours) > 1


# -- determinism (INV-3) ----------------------------------------------------


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
async def test_any_split_is_bit_identical_to_one_prefill(
    onnx_engine: OnnxEngine, data: st.DataObject
) -> None:
    n = data.draw(st.integers(2, 90), label="n")
    hist = history(data.draw(st.integers(0, 1000), label="seed"), n)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, n - 1), max_size=12), label="cuts")))
    lp_from = data.draw(st.integers(1, n - 1), label="lp_from")
    params = SamplingParams(
        max_tokens=6,
        temperature=data.draw(st.sampled_from([0.0, 0.7, 1.3])),
        top_p=0.9,
        seed=data.draw(st.integers(0, 2**40)),
    )
    opts = OutputOptions(logprob_top_k=3, logprob_ranges=((lp_from, n),))
    onnx_engine.forget("warm")
    for c in cuts:  # build the history in pieces, some with a decode in between
        await collect(
            onnx_engine, "warm", hist[:c], SamplingParams(max_tokens=c % 2, temperature=0)
        )
    warm = await collect(onnx_engine, "warm", hist, params, opts)
    onnx_engine.forget("cold")
    cold = await collect(onnx_engine, "cold", hist, params, opts)
    assert warm == cold
    fork_at = cuts[0] if cuts else 1
    onnx_engine.fork("warm", "forked", fork_at)
    assert await collect(onnx_engine, "forked", hist, params, opts) == cold


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
async def test_generated_history_is_bit_identical_to_one_prefill(
    onnx_engine: OnnxEngine, data: st.DataObject
) -> None:
    """A conversation: user pieces and generated replies (some cut short) build the history,
    so the warm cache holds KV made by decode passes; a cold prefill must agree bitwise."""
    rng = np.random.default_rng(data.draw(st.integers(0, 1000), label="seed"))
    hist = [int(t) for t in rng.integers(0, 256, data.draw(st.integers(1, 12), label="first"))]
    onnx_engine.forget("warm")
    for turn in range(data.draw(st.integers(1, 4), label="turns")):
        params = SamplingParams(
            max_tokens=data.draw(st.integers(0, 9), label="reply"),
            temperature=data.draw(st.sampled_from([0.0, 1.0])),
            seed=turn,
        )
        stop_at = data.draw(st.integers(1, 10), label="stop_at")
        gen = cast(AsyncGenerator[Step, None], onnx_engine.generate("warm", hist, params))
        reply: list[int] = []
        async for step in gen:
            reply.append(step.token_id)
            if len(reply) == stop_at:  # the caller stops listening mid-reply
                break
        await gen.aclose()
        hist = (
            hist
            + reply
            + [int(t) for t in rng.integers(0, 256, data.draw(st.integers(0, 6), label="user"))]
        )
    n = len(hist)
    params = SamplingParams(max_tokens=5, temperature=0.9, seed=data.draw(st.integers(0, 2**40)))
    opts = OutputOptions(logprob_top_k=3, logprob_ranges=((max(1, n - 20), n),))
    warm = await collect(onnx_engine, "warm", hist, params, opts)
    onnx_engine.forget("cold")
    cold = await collect(onnx_engine, "cold", hist, params, opts)
    assert warm == cold


async def test_decode_steps_equal_prefill_logits(onnx_engine: OnnxEngine, tiny_dir: Path) -> None:
    hist = history(3, 12)
    steps = await collect(onnx_engine, "d", hist, SamplingParams(max_tokens=10, temperature=0))
    full = hist + [s.token_id for s in steps]
    logits = raw_prefill(tiny_dir, full)["logits"][0]
    for s in steps:
        assert s.logprob is not None
        assert agrees(
            onnx_engine, s.logprob, float(log_softmax(logits[s.position - 1])[s.token_id])
        )


async def test_io_binding_path_gives_the_same_results(
    onnx_engine: OnnxEngine, tiny_dir: Path
) -> None:
    bound = OnnxEngine(model_dir=tiny_dir, io_binding=True, intra_op_threads=1)
    hist = history(4, 30)
    params = SamplingParams(max_tokens=5, seed=9)
    a = await collect(bound, "b", hist[:20], params)
    b = await collect(bound, "b", hist, params, OutputOptions(logprob_top_k=2))
    assert b == await collect(onnx_engine, "c", hist, params, OutputOptions(logprob_top_k=2))
    assert a == await collect(onnx_engine, "c2", hist[:20], params)


# -- caches -------------------------------------------------------------------


async def test_second_turn_prefills_only_new_tokens(onnx_engine: OnnxEngine) -> None:
    alone_only(onnx_engine)
    hist = history(5, 30)
    first = await collect(onnx_engine, "t", hist, SamplingParams(max_tokens=5, temperature=0))
    assert onnx_engine.positions_computed == 30 + 4  # the last token is not run until needed
    assert onnx_engine.cached_length("t") == 34
    assert onnx_engine.kv_live_bytes("t") > 0
    turn2 = hist + [s.token_id for s in first] + history(6, 10)
    before = onnx_engine.positions_computed
    await collect(onnx_engine, "t", turn2, SamplingParams(max_tokens=3, temperature=0))
    assert onnx_engine.positions_computed - before == 11 + 2


async def test_fork_shares_the_parent_prefix(onnx_engine: OnnxEngine) -> None:
    alone_only(onnx_engine)
    hist = history(7, 40)
    await collect(onnx_engine, "p", hist, prefill_only())
    total = onnx_engine.cache.total_bytes
    onnx_engine.fork("p", "c", 25)
    assert onnx_engine.cached_length("c") == 25
    assert onnx_engine.cache.total_bytes == total  # shared, not copied
    child = hist[:25] + history(8, 5)
    before = onnx_engine.positions_computed
    got = await collect(onnx_engine, "c", child, SamplingParams(max_tokens=4, seed=1))
    assert onnx_engine.positions_computed - before == 5 + 3
    assert onnx_engine.cached_length("p") == 40  # the parent is untouched
    assert got == await collect(onnx_engine, "cold", child, SamplingParams(max_tokens=4, seed=1))


async def test_truncation_rewinds_to_the_common_prefix(onnx_engine: OnnxEngine) -> None:
    alone_only(onnx_engine)
    hist = history(9, 50)
    await collect(onnx_engine, "r", hist, prefill_only())
    edited = hist[:20] + history(10, 7)
    before = onnx_engine.positions_computed
    got = await collect(onnx_engine, "r", edited, SamplingParams(max_tokens=3, seed=2))
    assert onnx_engine.positions_computed - before == 7 + 2
    assert onnx_engine.cached_length("r") == 29
    assert got == await collect(onnx_engine, "cold", edited, SamplingParams(max_tokens=3, seed=2))


async def test_eviction_under_a_memory_bound_then_transparent_recompute(tiny_dir: Path) -> None:
    eng = OnnxEngine(model_dir=tiny_dir, intra_op_threads=1)
    per_pos = eng.spec.kv_bytes_per_position()
    a, b = history(11, 60), history(12, 60)
    params = SamplingParams(max_tokens=4, seed=3)
    first = await collect(eng, "a", a, params)
    one = eng.kv_live_bytes("a")
    assert one >= 60 * per_pos  # a static buffer counts its whole capacity
    eng.cache.max_bytes = bound = one * 3 // 2  # room for one session's cache, not two
    await collect(eng, "b", b, params)
    assert eng.cached_length("a") is None and eng.cache.evictions >= 1
    assert eng.cache.total_bytes <= bound
    before = eng.positions_computed
    again = await collect(eng, "a", a, params)
    assert again == first
    assert eng.positions_computed - before == 60 + 3


async def test_forget_drops_the_cache(onnx_engine: OnnxEngine) -> None:
    await collect(onnx_engine, "f", history(13, 10), prefill_only())
    assert onnx_engine.cached_length("f") == 10
    onnx_engine.forget("f")
    assert onnx_engine.cached_length("f") is None and onnx_engine.kv_live_bytes("f") == 0
    # all of the cache's bytes were this session's (beside neighbours: theirs remain)
    others = sum(onnx_engine.kv_live_bytes(f"neighbour-{i}") for i in range(3))
    assert onnx_engine.cache.total_bytes <= others


# -- parameters and limits ------------------------------------------------------


async def test_stop_ids_end_after_yielding_the_stop_token(onnx_engine: OnnxEngine) -> None:
    hist = history(14, 8)
    free = await collect(onnx_engine, "x", hist, SamplingParams(max_tokens=8, temperature=0))
    stop = free[2].token_id
    first_hit = next(i for i, s in enumerate(free) if s.token_id == stop)
    got = await collect(
        onnx_engine, "y", hist, SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(stop,))
    )
    assert [s.token_id for s in got] == [s.token_id for s in free[: first_hit + 1]]


async def test_context_overflow_leaves_the_cache_alone(tiny_dir: Path) -> None:
    eng = OnnxEngine(model_dir=tiny_dir, max_length=32, intra_op_threads=1)
    await collect(eng, "o", history(15, 20), prefill_only())
    with pytest.raises(ContextOverflow):
        await collect(eng, "o", history(15, 32), SamplingParams(max_tokens=1))
    with pytest.raises(ContextOverflow):
        await collect(eng, "o", history(15, 33), prefill_only())
    assert eng.cached_length("o") == 20
    with pytest.raises(InvalidParameters):
        await collect(eng, "e", [], SamplingParams(max_tokens=1))


async def test_the_event_loop_keeps_serving_during_a_pass(onnx_engine: OnnxEngine) -> None:
    alone_only(onnx_engine)
    ticks = 0
    done = False

    async def heartbeat() -> None:
        nonlocal ticks
        while not done:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(heartbeat())
    before = ticks
    await collect(onnx_engine, "long", history(16, 1500), prefill_only())
    done = True
    await task
    assert ticks - before > onnx_engine.passes


def test_cli_builds_the_demo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from sessiontape.engines.onnx.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(
        ["model", "build-demo", "--size", "tiny", "--out", str(tmp_path / "m")]
    )
    assert args.func(args) == 0
    assert (tmp_path / "m" / "model.onnx").exists() and "built tiny" in capsys.readouterr().out


# -- decode hops and cancellation ------------------------------------------------


@pytest.mark.parametrize("batch", [1, 3, 16])
async def test_stopping_at_any_step_leaves_a_cache_of_what_was_yielded(
    tiny_dir: Path, batch: int
) -> None:
    eng = OnnxEngine(model_dir=tiny_dir, intra_op_threads=1, decode_batch=batch)
    hist = history(17, 20)
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=5)
    full = await collect(eng, "ref", hist, params)
    for stop_after in (1, 2, 5, 9):
        eng.forget("s")
        gen = cast(AsyncGenerator[Step, None], eng.generate("s", hist, params))
        got = []
        async for step in gen:
            got.append(step)
            if len(got) == stop_after:
                break
        await gen.aclose()
        assert got == full[:stop_after]
        cached = eng.cached_length("s")
        assert cached is not None and len(hist) <= cached <= len(hist) + stop_after
        entry = eng.cache.get("s")
        assert entry is not None and entry.tokens == (hist + [s.token_id for s in got])[:cached]
        # the continuation from the cache equals the uninterrupted generation
        rest = await collect(
            eng,
            "s",
            hist + [s.token_id for s in got],
            SamplingParams(max_tokens=12 - stop_after, temperature=0.8, seed=5),
        )
        assert got + rest == full


@pytest.mark.parametrize("batching", [False, True])
async def test_a_failing_pass_mid_decode_raises_engine_error_and_keeps_the_cache(
    tiny_dir: Path, batching: bool
) -> None:
    eng = OnnxEngine(
        model_dir=tiny_dir, intra_op_threads=1, decode_batch=4, batch_slots=4 if batching else 0
    )
    hist = history(18, 10)
    # the single-session hops run passes through the runner; the batch scheduler runs its own
    target: Any = eng._batch if batching else eng.runner
    name = "_pass" if batching else "run"
    got: list[Step] = []
    with (
        failing_once(target, name, 4, EngineError("onnxruntime run failed: injected")),
        pytest.raises(EngineError, match="injected"),
    ):
        async for step in eng.generate("f", hist, SamplingParams(max_tokens=10, temperature=0)):
            got.append(step)
    assert 1 <= len(got) < 10
    entry = eng.cache.get("f")
    assert entry is not None and entry.users == 0
    assert entry.tokens == (hist + [s.token_id for s in got])[: len(entry.tokens)]
    again = await collect(eng, "f", hist, SamplingParams(max_tokens=10, temperature=0))
    assert [s.token_id for s in again[: len(got)]] == [s.token_id for s in got]


async def test_decode_batch_does_not_change_results(tiny_dir: Path) -> None:
    hist = history(19, 15)
    params = SamplingParams(max_tokens=9, temperature=1.1, seed=77)
    opts = OutputOptions(logprob_top_k=2, readout_ranges=((16, 19),))
    outs = []
    for batch in (1, 2, 16):
        eng = OnnxEngine(model_dir=tiny_dir, intra_op_threads=1, decode_batch=batch)
        outs.append(await collect(eng, "b", hist, params, opts))
    assert outs[0] == outs[1] == outs[2]
    assert [s.position for s in outs[0] if s.readout is not None] == [16, 17, 18]


async def test_steady_decoding_never_copies_the_kv(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    eng = OnnxEngine(model_dir=tiny_dir, intra_op_threads=1)
    trims: list[int] = []
    real_trim = eng.runner.trim

    def counting(kv: Any, keep: int) -> Any:
        if kv.length != keep:
            trims.append(keep)
        return real_trim(kv, keep)

    monkeypatch.setattr(eng.runner, "trim", counting)
    hist = history(20, 9)
    first = await collect(eng, "k", hist, SamplingParams(max_tokens=30, temperature=0))
    assert trims == []
    # the next call starts from a snapshot that may end in a padding row: at most one copy
    await collect(
        eng, "k", hist + [s.token_id for s in first], SamplingParams(max_tokens=30, temperature=0)
    )
    assert len(trims) <= 1


async def test_lookahead_hits_give_the_same_results_as_no_lookahead(tiny_dir: Path) -> None:
    on = OnnxEngine(model_dir=tiny_dir, intra_op_threads=1)
    off = OnnxEngine(model_dir=tiny_dir, intra_op_threads=1, lookahead=False)
    bound = OnnxEngine(model_dir=tiny_dir, intra_op_threads=1, io_binding=True)
    hist = list(b"abcabcabcabc xyz abcabc") + history(21, 5)
    cases = [
        (SamplingParams(max_tokens=40, temperature=0), OutputOptions()),
        (SamplingParams(max_tokens=40, temperature=0.6, seed=3), OutputOptions(logprob_top_k=3)),
        (SamplingParams(max_tokens=30, temperature=0), OutputOptions(readout_ranges=((35, 40),))),
    ]
    for params, opts in cases:
        want = await collect(off, "x", hist, params, opts)
        assert await collect(on, "x", hist, params, opts) == want
        assert (
            await collect(bound, "x", hist, params, opts) == want
        )  # OrtValue snapshots, same scheme
    assert (
        on.lookahead_hits > 0
        and bound.lookahead_hits == on.lookahead_hits
        and off.lookahead_hits == 0
    )
    assert on.passes < off.passes  # every hit saved a pass
    # a session whose KV came from guessed rows continues exactly like a cold one
    turn2 = hist + [s.token_id for s in await collect(on, "y", hist, cases[0][0])] + list(b"abc")
    assert await collect(on, "y", turn2, cases[1][0], cases[1][1]) == await collect(
        off, "cold", turn2, cases[1][0], cases[1][1]
    )


async def test_rewind_trims_the_cache_to_the_committed_length(onnx_engine: OnnxEngine) -> None:
    alone_only(onnx_engine)
    hist = history(40, 20)
    params = SamplingParams(max_tokens=6, temperature=0.7, seed=8)
    steps = await collect(onnx_engine, "r", hist, params)
    full = hist + [s.token_id for s in steps]
    cached = onnx_engine.cached_length("r")
    assert cached is not None and cached > 22
    onnx_engine.rewind("r", 22)  # the runtime committed only two of the generated tokens
    entry = onnx_engine.cache.get("r")
    assert entry is not None and entry.tokens == full[:22] and onnx_engine.kv_live_bytes("r") > 0
    onnx_engine.rewind("r", 30)  # past the cache: nothing to trim
    onnx_engine.rewind("unknown", 3)
    assert onnx_engine.cached_length("r") == 22
    other = [*full[:22], (full[22] + 1) % 256]  # the log continued differently
    before = onnx_engine.positions_computed
    got = await collect(onnx_engine, "r", other, params)
    assert onnx_engine.positions_computed - before == 1 + len(got) - 1
    assert got == await collect(onnx_engine, "cold", other, params)


async def test_a_concat_layout_model_takes_the_growing_snapshot_path(tmp_path: Path) -> None:
    """Generic decoder-only models (present = past + new) still run, bit-exact on the CPU."""
    build_demo("tiny", tmp_path, layout="concat")
    eng = OnnxEngine(model_dir=tmp_path, intra_op_threads=1)
    assert not eng.spec.static and eng.info.extra["kv_layout"] == "concat"
    if eng.info.provider == "CPUExecutionProvider":
        with pytest.raises(ConfigError, match="static-layout"):
            OnnxEngine(model_dir=tmp_path, pass_rows=4)
    hist = history(41, 30)
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=2)
    opts = OutputOptions(logprob_top_k=2, logprob_ranges=((5, 40),))
    for cut in (7, 19):
        await collect(eng, "warm", hist[:cut], SamplingParams(max_tokens=1, temperature=0))
    assert await collect(eng, "warm", hist, params, opts) == await collect(
        eng, "cold", hist, params, opts
    )
    logits = raw_prefill(tmp_path, hist)["logits"][0]
    steps = await collect(eng, "p", hist, prefill_only(), OutputOptions(logprob_ranges=((1, 30),)))
    for s in steps:
        assert s.logprob is not None
        assert agrees(eng, s.logprob, float(log_softmax(logits[s.position - 1])[hist[s.position]]))


async def test_positions_keep_their_bits_when_the_buffer_grows(onnx_engine: OnnxEngine) -> None:
    """On the CPU the static buffer grows in 256-slot steps: a position computed over 256 slots
    (cold, first chunk) and over 512 (warm, after growing) must agree (fixed shapes: trivially)."""
    hist = history(42, 300)
    params = SamplingParams(max_tokens=4, temperature=0.9, seed=11)
    opts = OutputOptions(logprob_top_k=2, logprob_ranges=((180, 300),))
    await collect(onnx_engine, "warm", hist[:200], SamplingParams(max_tokens=1, temperature=0))
    await collect(onnx_engine, "warm", hist[:270], prefill_only())
    warm = await collect(onnx_engine, "warm", hist, params, opts)
    assert warm == await collect(onnx_engine, "cold", hist, params, opts)


async def test_a_fork_writing_its_copy_leaves_the_parent_intact(onnx_engine: OnnxEngine) -> None:
    alone_only(onnx_engine)
    hist = history(43, 40)
    params = SamplingParams(max_tokens=5, temperature=0.8, seed=6)
    await collect(onnx_engine, "p", hist, prefill_only())
    onnx_engine.fork("p", "c", 20)
    await collect(
        onnx_engine, "c", hist[:20] + history(44, 15), params
    )  # writes slots 20.. of its copy
    before = onnx_engine.positions_computed
    got = await collect(onnx_engine, "p", hist, params)
    assert onnx_engine.positions_computed - before == 1 + 4  # the parent's 40 positions were kept
    assert got == await collect(onnx_engine, "cold", hist, params)


async def test_forgetting_a_generating_session_keeps_its_buffer_until_it_ends(
    onnx_engine: OnnxEngine,
) -> None:
    hist = history(45, 25)
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=7)
    want = await collect(onnx_engine, "ref", hist, params)
    gen = cast(AsyncGenerator[Step, None], onnx_engine.generate("g", hist, params))
    got = []
    async for step in gen:
        got.append(step)
        if len(got) == 3:
            onnx_engine.forget("g")  # the session closed while generating
            await collect(onnx_engine, "other", history(46, 30), params)  # takes a buffer meanwhile
    assert got == want
    assert onnx_engine.cached_length("g") is None
