"""``--dtype float16``: the graph computes in float16, on small random checkpoints.

Each checkpoint (tests/helpers/checkpoints.py) is imported twice, as float32 (the exact
path, within 1e-4 of the numpy forward pass: test_architectures.py) and as float16, and the
float16 graph is held to the float32 one and to the numpy forward pass over the weights
rounded to float16.

Tolerances (hidden 64, two layers; the logits spread over about +-10):

* logits within 0.1 absolute of the float32 path, and a relative RMS error under 1e-2.
  Measured: 0.017 to 0.026 absolute, 1.4e-3 to 1.9e-3 relative, either attention. Rounding
  the weights to float16 alone moves the float64 reference by 0.013 to 0.018, and float16
  activations (11-bit mantissas, relative steps of 4.9e-4) add about as much again, so 0.1
  is four times what was seen, while a wrong row order, bias, scale or rotary convention
  moves logits by whole units (test_architectures.py).
* not vacuous: the float16 logits differ from the float32 path's by more than 1e-3 (a graph
  that computed in float32 would be within 1e-5).
* the argmax: the same as the float32 path's at every position where the float32 path's
  best two logits are further apart than the tolerance (measured: the same everywhere).

Whatever the precision, a history's logits do not depend on how it was split into passes:
the engine's ids and logprobs are bit-exact however the history is built, and its KV
buffers hold float16 (half the float32 path's bytes per position).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import onnx
import pytest

from sessiontape.core.engine.interface import OutputOptions, SamplingParams, Step
from sessiontape.engines.onnx.engine import OnnxEngine
from sessiontape.engines.onnx.importer import import_model
from tests.helpers import checkpoints as ck
from tests.helpers.architectures import ARCHS, IDS, op_counts, weights
from tests.helpers.checkpoints import F64, Weights

ATOL = 0.1
REL_RMS = 1e-2
QT = gguf.GGMLQuantizationType
Import = Callable[..., Path]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Import:
    """``tiny(name, dtype, attention)``: the architecture's checkpoint (a Hugging Face
    folder) imported once per dtype and attention."""
    root = tmp_path_factory.mktemp("float16")
    done: dict[tuple[str, str, str], Path] = {}

    def get(name: str, dtype: str, attention: str = "gqa") -> Path:
        key = (name, dtype, attention)
        if key not in done:
            src = root / f"src-{name}"
            if not src.exists():
                ck.write_hf(src, ARCHS[name], weights(ARCHS[name]))
            out = root / f"{name}-{dtype}-{attention}"
            done[key] = import_model(
                src, out, dtype, concepts=False, attention=attention, name=f"tiny-{name}"
            ).folder
        return done[key]

    return get


def rounded(w: Weights) -> Weights:
    return {k: v.astype(np.float16).astype(np.float32) for k, v in w.items()}


def assert_close_to(got: F64, ref: F64) -> None:
    assert got.shape == ref.shape == (len(IDS), ck.VOCAB)
    worst = float(np.abs(got - ref).max())
    rel = float(np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref**2)))
    assert worst <= ATOL and rel <= REL_RMS, (worst, rel)


@pytest.mark.parametrize("attention", ["gqa", "masked"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
def test_float16_logits_are_close_to_the_float32_path(
    name: str, attention: str, tiny: Import
) -> None:
    arch = ARCHS[name]
    f32 = ck.run_imported(tiny(name, "float32", attention), IDS)
    f16 = ck.run_imported(tiny(name, "float16", attention), IDS)
    assert_close_to(f16, f32)
    assert_close_to(f16, ck.forward(arch, rounded(weights(arch)), IDS))
    assert float(np.abs(f16 - f32).max()) > 1e-3  # it does compute in float16
    top2 = np.sort(f32, axis=-1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > ATOL
    assert clear.sum() >= len(IDS) // 2
    assert np.array_equal(f16.argmax(-1)[clear], f32.argmax(-1)[clear])


@pytest.mark.parametrize("attention", ["gqa", "masked"])
def test_the_graph_is_float16_inside_and_float32_at_its_outputs(
    attention: str, tiny: Import
) -> None:
    folder = tiny("qwen2", "float16", attention)  # qwen2: q/k/v biases, tied embeddings
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    F16, F32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
    io = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.output]}
    kv = [n for n in io if n.startswith(("past_key_values.", "present."))]
    assert len(kv) == 4 * ARCHS["qwen2"].layers and all(io[n] == F16 for n in kv)
    outs = ["logits", *(f"hidden_states.{i}" for i in range(ARCHS["qwen2"].layers + 1))]
    assert all(io[n] == F32 for n in outs)
    floats = [t for t in model.graph.initializer if t.data_type in (F16, F32)]
    assert floats and all(t.data_type == F16 for t in floats), [
        t.name for t in floats if t.data_type != F16
    ]
    ops = op_counts(folder)
    assert ops["Cast"] >= len(outs) and "MatMulNBits" not in ops
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["dtype"] == "float16" and cfg["float_type"] == "float16"
    # the float32 import is float32 throughout, as before
    f32 = onnx.load(
        str(tiny("qwen2", "float32", attention) / "model.onnx"), load_external_data=False
    )
    assert all(t.data_type != F16 for t in f32.graph.initializer)
    assert all(v.type.tensor_type.elem_type != F16 for v in f32.graph.input)


@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q8_0, QT.Q4_0], ids=lambda q: q.name)
def test_quantized_gguf_blocks_dequantize_to_float16(qtype: QT, tmp_path: Path) -> None:
    arch = ARCHS["llama"]
    src = ck.write_gguf(tmp_path / "tiny.gguf", arch, weights(arch), qtype)
    out = import_model(src.path, tmp_path / "out", "float16", concepts=False).folder
    ops = op_counts(out)
    assert "MatMulNBits" not in ops and "GatherBlockQuantized" not in ops
    got = ck.run_imported(out, IDS)
    assert_close_to(got, ck.forward(arch, src.weights, IDS))
    f32 = import_model(src.path, tmp_path / "f32", "float32", concepts=False).folder
    assert_close_to(got, ck.run_imported(f32, IDS))


# -- through the engine ---------------------------------------------------------------------


def engine(folder: Path, **kw: Any) -> OnnxEngine:
    return OnnxEngine(model_dir=folder, intra_op_threads=1, **kw)


@pytest.fixture
def engines() -> Iterator[Callable[..., OnnxEngine]]:
    made: list[OnnxEngine] = []

    def make(folder: Path, **kw: Any) -> OnnxEngine:
        made.append(engine(folder, **kw))
        return made[-1]

    yield make
    for eng in made:
        asyncio.run(eng.aclose())


def generate(
    eng: OnnxEngine, key: str, history: Sequence[int], params: SamplingParams
) -> list[Step]:
    async def go() -> list[Step]:
        opts = OutputOptions(logprob_top_k=3, logprob_ranges=((1, len(history)),))
        return [s async for s in eng.generate(key, list(history), params, opts)]

    return asyncio.run(go())


GREEDY = SamplingParams(max_tokens=20, temperature=0.0)
PROMPT = IDS[:12]  # up to the end-of-turn token inside IDS


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_greedy_ids_agree_with_the_float32_path(
    name: str, tiny: Import, engines: Callable[..., OnnxEngine]
) -> None:
    a = [s for s in generate(engines(tiny(name, "float32")), "a", PROMPT, GREEDY)]
    b = [s for s in generate(engines(tiny(name, "float16")), "b", PROMPT, GREEDY)]
    assert [s.token_id for s in b] == [s.token_id for s in a]
    assert sum(not s.is_prefill for s in b) >= 8
    lp = [(x.logprob, y.logprob) for x, y in zip(a, b, strict=True) if x.logprob is not None]
    assert lp and max(abs(float(x) - float(y or 0)) for x, y in lp) < ATOL


@pytest.mark.parametrize("attention", ["gqa", "masked"])
def test_bit_exact_however_the_history_is_built(
    attention: str, tiny: Import, engines: Callable[..., OnnxEngine]
) -> None:
    assert_bit_exact(engines, tiny("llama", "float16", attention))


def assert_bit_exact(engines: Callable[..., OnnxEngine], folder: Path, **kw: Any) -> None:
    """One pass, prefill in chunks of 3, a warm session continued, a fork: the same ids,
    logprobs and top logprobs, to the bit."""
    one = engines(folder, prefill_chunk=256, **kw)
    small = engines(folder, prefill_chunk=3, **kw)
    full = generate(one, "cold", PROMPT, GREEDY)
    gen = [s.token_id for s in full if not s.is_prefill]
    assert len(gen) >= 8
    assert generate(small, "chunked", PROMPT, GREEDY) == full
    head = SamplingParams(max_tokens=4, temperature=0.0)
    first = generate(one, "warm", PROMPT, head)
    assert first == full[: len(first)]
    rest = generate(one, "warm", PROMPT + gen[:4], SamplingParams(max_tokens=16, temperature=0))
    tail = [s for s in full if not s.is_prefill][4:]
    assert [s for s in rest if not s.is_prefill] == tail[: len(gen) - 4]
    one.fork("warm", "child", len(PROMPT) + 2)
    child = generate(one, "child", PROMPT + gen[:2], SamplingParams(max_tokens=18, temperature=0))
    assert [s for s in child if not s.is_prefill] == [s for s in full if not s.is_prefill][2:]
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=3)
    assert generate(one, "s1", PROMPT, seeded) == generate(small, "s2", PROMPT, seeded)


def test_kv_buffers_are_float16(tiny: Import, engines: Callable[..., OnnxEngine]) -> None:
    e16, e32 = engines(tiny("llama", "float16")), engines(tiny("llama", "float32"))
    assert np.dtype(e16.spec.kv_dtype) == np.float16 and np.dtype(e32.spec.kv_dtype) == np.float32
    assert 2 * e16.spec.kv_bytes_per_position() == e32.spec.kv_bytes_per_position()
    generate(e16, "k", PROMPT, GREEDY)
    entry = e16.cache.get("k")
    assert entry is not None and entry.kv is not None
    kinds = {_elem(t) for t in entry.kv.tensors}
    assert kinds == {"float16"}, kinds


def _elem(t: Any) -> str:
    """A KV tensor's element type: an OrtValue's or a numpy array's."""
    if hasattr(t, "data_type"):
        return str(t.data_type()).removeprefix("tensor(").removesuffix(")")
    return str(np.asarray(t).dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("attention", ["gqa", "masked"])
def test_float16_on_cuda_is_bit_exact_and_agrees_with_float32(
    attention: str, tiny: Import, engines: Callable[..., OnnxEngine]
) -> None:
    """What float16 is for: the CUDA provider (its fixed pass shape, CUDA graphs, device KV)."""
    from sessiontape.engines.onnx.runner import CUDA, cuda_loads, quiet_ort

    if CUDA not in quiet_ort().get_available_providers() or not cuda_loads():
        pytest.skip("no CUDA provider here (onnxruntime-gpu, a GPU and CUDA libraries)")
    folder = tiny("llama", "float16", attention)
    gpu = engines(folder, providers="auto")
    if gpu.info.provider != CUDA:
        pytest.skip("the CUDA provider did not load here")
    assert_bit_exact(engines, folder, providers="auto")
    cpu32 = engines(tiny("llama", "float32", attention), providers="CPUExecutionProvider")
    a = [s.token_id for s in generate(cpu32, "a", PROMPT, GREEDY)]
    assert [s.token_id for s in generate(gpu, "b", PROMPT, GREEDY)] == a
    entry = gpu.cache.get("b")
    assert entry is not None and entry.kv is not None
    assert {_elem(t) for t in entry.kv.tensors} == {"float16"}
    assert all(t.device_name().lower() == "cuda" for t in entry.kv.tensors)
