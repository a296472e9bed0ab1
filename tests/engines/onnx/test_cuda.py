"""What only means something on a GPU: the CUDA provider's pass shape, device-resident KV, CUDA graphs.

Every test here is marked ``cuda`` and skips with a reason where this
onnxruntime build or machine has no CUDA provider. The provider-independent
suite (test_engine.py, bit-exactness included) runs on CUDA as it is.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sessiontape.core.engine.interface import OutputOptions, SamplingParams
from sessiontape.engines.onnx import OnnxEngine
from sessiontape.engines.onnx.runner import CUDA, cuda_loads, quiet_ort
from tests.helpers.onnx import collect, history

pytestmark = pytest.mark.cuda


@pytest.fixture
def cuda_engine(tiny_dir: Path) -> OnnxEngine:
    if CUDA not in quiet_ort().get_available_providers():
        pytest.skip("this onnxruntime build has no CUDAExecutionProvider (install onnxruntime-gpu)")
    if not cuda_loads():
        pytest.skip("the CUDA provider does not load here (no GPU or no CUDA 13 libraries)")
    eng = OnnxEngine(model_dir=tiny_dir, providers="auto")
    if eng.info.provider != CUDA:
        pytest.skip("the CUDA provider did not load here (no GPU or no CUDA libraries)")
    return eng


def test_auto_picks_cuda_with_a_fixed_shape_and_a_cuda_graph(cuda_engine: OnnxEngine) -> None:
    extra = cuda_engine.info.extra
    assert extra["kv_layout"] == "static" and extra["cuda_graph"] is True
    assert (
        extra["pass_rows"] == 16
        and extra["kv_capacity"] == -(-(cuda_engine.info.max_length + 1) // 64) * 64
    )


async def test_the_kv_buffer_lives_on_the_device_and_is_updated_in_place(
    cuda_engine: OnnxEngine,
) -> None:
    hist = history(30, 40)
    await collect(cuda_engine, "k", hist, SamplingParams(max_tokens=5, temperature=0))
    entry = cuda_engine.cache.get("k")
    assert entry is not None and entry.kv is not None
    buf = entry.kv
    assert all(t.device_name().lower() == "cuda" for t in buf.tensors)
    assert cuda_engine.kv_live_bytes("k") == cuda_engine.runner.nbytes(
        cuda_engine.info.extra["kv_capacity"]
    )
    await collect(
        cuda_engine, "k", hist + list(b" more"), SamplingParams(max_tokens=5, temperature=0)
    )
    assert (
        cuda_engine.cache.get("k") is entry and entry.kv is buf
    )  # the same buffer, written in place


async def test_every_pass_is_a_graph_replay_so_buffers_agree(
    cuda_engine: OnnxEngine, tiny_dir: Path
) -> None:
    """A new buffer's graph is captured before its first real pass: a pass run outside a capture
    may take other cuBLAS kernels than its replay, so that would break warm == cold."""
    plain = OnnxEngine(model_dir=tiny_dir, providers="auto", cuda_graph=False)
    hist = history(31, 50)
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=4)
    opts = OutputOptions(logprob_top_k=3, logprob_ranges=((10, 80),))
    want = await collect(cuda_engine, "a", hist, params, opts)
    assert (
        await collect(cuda_engine, "b", hist, params, opts) == want
    )  # another buffer, its own graph
    cuda_engine.forget("a")
    assert await collect(cuda_engine, "c", hist, params, opts) == want  # a recycled buffer
    other = await collect(plain, "p", hist, params, opts)
    assert [s.token_id for s in other] == [s.token_id for s in want]
    for x, y in zip(other, want, strict=True):
        assert x.logprob is not None and y.logprob is not None and abs(x.logprob - y.logprob) < 1e-2


async def test_cuda_agrees_with_the_cpu_to_float_rounding(
    cuda_engine: OnnxEngine, tiny_dir: Path
) -> None:
    cpu = OnnxEngine(model_dir=tiny_dir, providers="CPUExecutionProvider", intra_op_threads=1)
    hist = history(32, 30)
    opts = OutputOptions(logprob_ranges=((1, 30),))
    a = await collect(cuda_engine, "x", hist, SamplingParams(max_tokens=0), opts)
    b = await collect(cpu, "x", hist, SamplingParams(max_tokens=0), opts)
    assert [s.position for s in a] == [s.position for s in b]
    for x, y in zip(a, b, strict=True):
        assert x.logprob is not None and y.logprob is not None
        assert abs(x.logprob - y.logprob) < 1e-2  # cuBLAS multiplies float32 in TF32 by default
