"""GGUF's block formats (engines/models/quant.py) against the ``gguf`` package's own decoder.

Blocks are random bytes: every bit pattern of codes, sub-block scales and mins is a valid
block, so only the float16 fields (d, dmin, m) are set apart: either left random (NaN and
inf included: "bytes") or finite, of a random magnitude ("finite"). Each format must:

* dequantize bit for bit as ``gguf.quants.dequantize`` does;
* as a :class:`QuantMatrix` (the graph's MatMulNBits layout) hold the same values: bit for
  bit where the module's table says "exact", within a few float32 roundings of the block's
  magnitude for Q4_1 and Q4_K (whose offsets are computed);
* multiply through ONNX Runtime's MatMulNBits (float activations) as the dequantized
  matrix does through numpy, within float32 accumulation error.

A small Qwen2-shaped model whose matrices mix the formats per tensor, as llama.cpp's
``_K_M`` presets do, imports with its blocks kept and computes the numpy reference's logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessiontape.core.errors import UnsupportedModel
from sessiontape.engines.models import quant
from sessiontape.engines.onnx.decoder import gather_blocks
from sessiontape.engines.onnx.graph import INDICATOR_MAX_K, MS, Graph
from sessiontape.engines.onnx.importer import ensure_imported, import_model
from sessiontape.engines.weights import QuantMatrix, concat_out, relayout
from tests.helpers import checkpoints as ck
from tests.helpers.mixed_gguf import (
    MIXED,
    gguf_dequantized,
    random_blocks,
    scaled_blocks,
    write_mixed,
)

QT = gguf.GGMLQuantizationType
KINDS = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K]
KINDS += [QT.Q6_K, QT.IQ4_NL, QT.IQ4_XS]
#: formats whose QuantMatrix computes its offsets (one float32 rounding)
ROUNDED = (QT.Q4_1, QT.Q4_K)
EPS = float(np.finfo(np.float32).eps)


cases = st.tuples(
    st.sampled_from(KINDS),
    st.integers(1, 3),
    st.integers(1, 3),
    st.integers(0, 2**32 - 1),
    st.sampled_from(["bytes", "finite"]),
)


@settings(derandomize=True, max_examples=200, deadline=None)
@given(cases)
def test_dequantize_is_bit_exact(case: tuple[QT, int, int, int, str]) -> None:
    qtype, rows, blocks, seed, kind = case
    values = gguf.GGML_QUANT_SIZES[qtype][0]
    raw = random_blocks(qtype, rows, blocks * values, np.random.default_rng(seed), kind)
    with np.errstate(all="ignore"):  # inf * 0 in a block of random bytes
        ours = quant.dequantize(raw, int(qtype))
        theirs = gguf_dequantized(raw, qtype)
    assert ours.dtype == np.float32 and ours.shape == theirs.shape == (rows, blocks * values)
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16], ids=lambda q: q.name)
def test_float_tensors_are_bit_exact(qtype: QT) -> None:
    rng = np.random.default_rng(5)
    raw = rng.integers(0, 256, (3, 64 * gguf.GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    with np.errstate(all="ignore"):
        ours = quant.dequantize(raw, int(qtype))
        theirs = gguf_dequantized(raw, qtype)
    assert ours.shape == (3, 64)
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


@settings(derandomize=True, max_examples=150, deadline=None)
@given(cases)
def test_kept_blocks_hold_the_same_values(case: tuple[QT, int, int, int, str]) -> None:
    qtype, rows, blocks, seed, _ = case
    values = gguf.GGML_QUANT_SIZES[qtype][0]
    raw = random_blocks(qtype, rows, blocks * values, np.random.default_rng(seed))
    theirs = gguf_dequantized(raw, qtype)
    m = quant.to_matrix(raw, int(qtype))
    fmt = quant.FORMATS[int(qtype)]
    assert (m.n, m.k, m.bits) == (rows, blocks * values, fmt.bits)
    ours = m.dequantize()
    if qtype not in ROUNDED:
        assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
        return
    dec = fmt.decode(raw.reshape(-1, fmt.size))
    assert dec.bias is not None
    bound = 4 * EPS * (24 * np.abs(dec.scale) + np.abs(dec.bias))
    err = np.abs(ours - theirs).reshape(-1, m.block)
    assert (err <= bound[:, None]).all()


def matmul_nbits(m: QuantMatrix, x: Any, ops: list[str] | None = None) -> Any:
    """x @ m.T through ONNX Runtime (the graph builder's linear, float activations); the
    graph's operators go to ``ops``."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    g = Graph()
    g.linear("x", "w", m, accuracy_level=0, out="y")
    if ops is not None:
        ops.extend(n.op_type for n in g.nodes)
    graph = helper.make_graph(
        g.nodes,
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, None, m.k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, None, m.n])],
        g.inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(MS, 1)]
    )
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.asarray(sess.run(["y"], {"x": x[None]})[0][0], np.float64)


@pytest.mark.parametrize("qtype", KINDS, ids=lambda q: q.name)
def test_matmul_nbits_computes_the_dequantized_product(qtype: QT) -> None:
    rng = np.random.default_rng(int(qtype))
    values = gguf.GGML_QUANT_SIZES[qtype][0]
    raw = scaled_blocks(qtype, 48, 2 * max(values, 128), rng, 0.05)
    x = rng.standard_normal((5, raw.shape[1] // gguf.GGML_QUANT_SIZES[qtype][1] * values))
    x = x.astype(np.float32)
    w = gguf_dequantized(raw, qtype).astype(np.float64)
    want = x.astype(np.float64) @ w.T
    got = matmul_nbits(quant.to_matrix(raw, int(qtype)), x)
    # float32 sums of k products: a few ulp of sum |x||w| per output
    bound = 64 * EPS * (np.abs(x).astype(np.float64) @ np.abs(w).T)
    assert (np.abs(got - want) <= bound).all(), float(np.abs(got - want).max())


@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q4_K, QT.Q5_K], ids=lambda q: q.name)
def test_long_rows_sum_their_blocks_for_the_offsets(qtype: QT) -> None:
    """Past INDICATOR_MAX_K inputs the offsets' block sums are a ReduceSum: same product."""
    rng = np.random.default_rng(int(qtype) + 100)
    k = 2 * INDICATOR_MAX_K
    raw = scaled_blocks(qtype, 16, k, rng, 0.05)
    x = rng.standard_normal((3, k)).astype(np.float32)
    w = gguf_dequantized(raw, qtype).astype(np.float64)
    ops: list[str] = []
    got = matmul_nbits(quant.to_matrix(raw, int(qtype)), x, ops)
    assert "ReduceSum" in ops
    bound = 64 * EPS * (np.abs(x).astype(np.float64) @ np.abs(w).T)
    assert (np.abs(got - x.astype(np.float64) @ w.T) <= bound).all()


def test_mixed_formats_fuse_exactly() -> None:
    """q (Q4_K), k (Q6_K), v (Q5_0): one matrix of 8-bit blocks of 16, the same values."""
    rng = np.random.default_rng(9)
    parts = [
        quant.to_matrix(random_blocks(t, rows, 256, rng), int(t))
        for t, rows in ((QT.Q4_K, 8), (QT.Q6_K, 4), (QT.Q5_0, 4))
    ]
    fused = concat_out(list(parts))
    assert isinstance(fused, QuantMatrix)
    assert (fused.bits, fused.block, fused.n, fused.k) == (8, 16, 16, 256)
    want = np.concatenate([p.dequantize() for p in parts])
    # equal values (a zero offset added to the parts that had none turns -0.0 into 0.0)
    assert np.array_equal(fused.dequantize(), want)
    with pytest.raises(ValueError, match="do not fit"):
        relayout(parts[1], 4, 16)


@pytest.mark.parametrize("qtype", KINDS, ids=lambda q: q.name)
def test_eight_bit_blocks_hold_every_format_exactly(qtype: QT) -> None:
    """Embeddings: every format as 8-bit codes ``v + 128`` with its bias as the offsets,
    bit for bit gguf's values (GatherBlockQuantized reads those without offsets as is)."""
    raw = random_blocks(qtype, 6, 256, np.random.default_rng(4))
    m = quant.to_matrix(raw, int(qtype), bits=8)
    assert m.bits == 8
    assert (m.offsets is None) == (
        qtype in (QT.Q4_0, QT.Q5_0, QT.Q8_0, QT.Q3_K, QT.Q6_K, QT.IQ4_NL, QT.IQ4_XS)
    )
    assert np.array_equal(
        m.dequantize().view(np.uint32), gguf_dequantized(raw, qtype).view(np.uint32)
    )
    with pytest.raises(ValueError, match="does not fit"):
        quant.to_matrix(raw, int(qtype), bits=2)


@pytest.mark.parametrize("qtype", KINDS, ids=lambda q: q.name)
def test_embedding_rows_are_gathered_from_blocks_exactly(qtype: QT) -> None:
    """An embedding in any format, as the builder reads it (GatherBlockQuantized, 4 bits for
    the formats of at most 16 levels, 8 for the others; the offsets added after): the rows
    the ``gguf`` package dequantizes, bit for bit; the 4-bit formats in half the bytes."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    raw = random_blocks(qtype, 40, 256, np.random.default_rng(int(qtype) + 7))
    m = quant.to_matrix(raw, int(qtype), bits=8)
    g = Graph()
    g.i64("c_axis_neg1", -1)
    gather_blocks(g, m, "rows")
    codes = next(i for i in g.inits if i.name == "embed.q")
    four = qtype in (QT.Q4_0, QT.Q4_1, QT.Q2_K, QT.Q3_K, QT.Q4_K)
    assert list(codes.dims) == [40, 128 if four else 256]
    graph = helper.make_graph(
        g.nodes,
        "embedding",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, None])],
        [helper.make_tensor_value_info("rows", TensorProto.FLOAT, [1, None, 256])],
        g.inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(MS, 1)]
    )
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ids = np.array([[3, 0, 39, 3, 17]], np.int64)
    got = np.asarray(sess.run(["rows"], {"input_ids": ids})[0][0], np.float32)
    want = gguf_dequantized(raw, qtype)[ids[0]]
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


# -- a model that mixes formats per tensor --------------------------------------------------


def test_a_model_mixing_formats_keeps_its_blocks(tmp_path: Path) -> None:
    held = write_mixed(tmp_path / "mixed.gguf")
    ids = [int(i) for i in np.random.default_rng(3).integers(0, ck.VOCAB, 20)]
    ref = ck.forward(MIXED, held, ids)
    out = import_model(tmp_path / "mixed.gguf", tmp_path / "out", "auto", concepts=False).folder
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    # qkv, o, gate|up, down; the head; layer 0's q|k (Q4_K: 4 bits) apart from its v (Q6_K)
    assert ops.count("MatMulNBits") == 4 * MIXED.layers + 2
    assert ops.count("Concat") == 1
    assert ops.count("GatherBlockQuantized") == 1  # the Q6_K embedding, in 8-bit codes
    for node in model.graph.node:  # float activations: the kept blocks' values exactly
        for attr in node.attribute:
            if attr.name == "accuracy_level":
                attr.i = 1
    onnx.save(model, str(out / "float_activations.onnx"))
    got = ck.run_imported(out, ids, model="float_activations.onnx")
    scale = float(np.abs(ref).max())
    assert float(np.abs(got - ref).max()) <= 1e-4 * max(scale, 1.0)
    floats = import_model(tmp_path / "mixed.gguf", tmp_path / "f32", "float32", concepts=False)
    got32 = ck.run_imported(floats.folder, ids)
    assert float(np.abs(got32 - ref).max()) <= 1e-4 * max(scale, 1.0)


def test_unsupported_block_types_are_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = ck.LLAMA
    src = ck.write_gguf(tmp_path / "x.gguf", a, ck.random_weights(a), QT.Q8_0)
    data = bytearray(src.path.read_bytes())
    reader = gguf.GGUFReader(str(src.path))
    t = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    # the type field sits right before the tensor's u64 offset in its info
    info = bytes(t.name, "utf-8")
    at = data.index(info) + len(info) + 4 + 8 * len(t.shape)
    assert int.from_bytes(data[at : at + 4], "little") == int(QT.Q8_0)
    data[at : at + 4] = int(QT.MXFP4).to_bytes(4, "little")  # 17 bytes per 32 weights
    (tmp_path / "y.gguf").write_bytes(bytes(data))
    refusal = r"MXFP4.*blk\.0\.attn_q\.weight.*served: F32"
    with pytest.raises(UnsupportedModel, match=refusal):
        import_model(tmp_path / "y.gguf", tmp_path / "out", concepts=False)
    assert not (tmp_path / "out").exists()
    monkeypatch.setenv("SESSIONTAPE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(UnsupportedModel, match=refusal):  # serve --model: before any hashing
        ensure_imported(str(tmp_path / "y.gguf"))
    assert not (tmp_path / "cache").exists()
