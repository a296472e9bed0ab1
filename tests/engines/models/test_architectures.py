"""The importer against an independent numpy forward pass, per architecture and source format.

Each architecture (Llama, Qwen2, Mistral; tests/helpers/checkpoints.py) is a small
random checkpoint written here as a Hugging Face folder and as a GGUF file, imported with
:func:`import_model`, and run through onnxruntime; its logits at every position must be
those of a numpy forward pass over the weights the source holds.

Tolerances:

* float weights (dtype float32, or a GGUF's blocks dequantized on import): 1e-4 absolute.
  The logits spread over about +-10 (std 2 to 3), and float32 against the float64
  reference measures about 1e-5 (hidden 64, two layers), so 1e-4 is 1e-5 of the logits'
  range yet ten times the float32 rounding seen; a wrong row order, bias, scale or rotary
  convention moves logits by whole units.
* GGUF blocks kept as blocks (dtype auto): MatMulNBits at accuracy_level 4 quantizes its
  *activations* to int8 per block, which the numpy reference does not. Two checks: with the
  graph's accuracy_level set to 1 (float activations) the kept blocks must match the
  dequantized reference within the same 1e-4 (the repacking is exact); as imported, the
  logits' relative RMS error must stay under 8e-2 (measured 1.6e-2 to 2.5e-2: about 0.5%
  per int8-activation matmul, nine of them, amplified by softmax), the worst position under
  15% of the logit scale (measured up to 4.3%), the argmax must agree on at least 2/3 of
  the positions (measured 83% to 100%: near ties flip) and be among the reference's top 3
  everywhere (measured: top 2). Not undoing llama.cpp's Q/K permutation, by contrast,
  gives a relative RMS error of about 90% (test_gguf_llama_permutation_is_undone).
"""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file
from tokenizers import Tokenizer

from sessiontape.core.errors import ConfigError, UnsupportedModel
from sessiontape.engines.models import quant
from sessiontape.engines.onnx.importer import import_model
from tests.helpers import checkpoints as ck
from tests.helpers.architectures import ARCHS, IDS, op_counts, weights
from tests.helpers.checkpoints import F64, LLAMA, MISTRAL, QWEN2

ATOL = 1e-4
QT = gguf.GGMLQuantizationType
BLOCK_TYPES = [QT.Q8_0, QT.Q4_0, QT.Q4_1]


def imported(source: Path, out: Path, dtype: str = "float32") -> Path:
    return import_model(source, out, dtype=dtype, concepts=False).folder


def max_err(got: F64, ref: F64) -> float:
    return float(np.abs(got - ref).max())


def assert_logits(got: F64, ref: F64, atol: float = ATOL) -> None:
    assert got.shape == ref.shape == (len(IDS), ck.VOCAB)
    worst = np.abs(got - ref).max(axis=-1)
    assert worst.max() <= atol, f"max |diff| per position {np.round(worst, 7).tolist()}"


# -- Hugging Face folders -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
def test_hf_float32_checkpoint_matches_numpy(name: str, tmp_path: Path) -> None:
    arch = ARCHS[name]
    src = ck.write_hf(tmp_path / f"tiny-{name}", arch, weights(arch))
    out = imported(src, tmp_path / "out")
    assert_logits(ck.run_imported(out, IDS), ck.forward(arch, weights(arch), IDS))
    cfg = json.loads((out / "config.json").read_text())
    # Mistral's window (256) is shorter than its 1024 positions: served over all of them,
    # every layer attending over the window. Qwen2's window is switched off
    # (use_sliding_window false).
    assert cfg["max_length"] == arch.context
    assert (cfg["sliding_window"], cfg["local_layers"]) == (
        (256, [0, 1]) if name == "mistral" else (0, [])
    )
    assert cfg["qkv_bias"] is (name == "qwen2")
    assert (cfg["heads"], cfg["kv_heads"], cfg["head_dim"]) == (4, 2, 16)
    assert (cfg["vocab_size"], cfg["eos_token_id"], cfg["bos_token_id"]) == (
        ck.VOCAB,
        [ck.EOS_ID],
        ck.BOS_ID,
    )
    assert cfg["rope_theta"] == arch.rope_theta and cfg["eps"] == pytest.approx(arch.eps)
    assert (out / "tokenizer.json").read_text() == (src / "tokenizer.json").read_text()
    assert (out / "chat_template.jinja").read_text() == ck.CHAT_TEMPLATE


def test_hf_bfloat16_checkpoint_matches_numpy(tmp_path: Path) -> None:
    """BF16 tensors (written by hand: safetensors.numpy has no bfloat16) widen exactly."""
    held = ck.bf16_round(weights(LLAMA))
    src = ck.write_hf(tmp_path / "tiny-bf16", LLAMA, weights(LLAMA), bf16=True)
    got = ck.run_imported(imported(src, tmp_path / "out"), IDS)
    ref = ck.forward(LLAMA, held, IDS)
    assert_logits(got, ref)
    # not vacuous: bfloat16 rounding moves the logits far more than the tolerance
    assert max_err(ref, ck.forward(LLAMA, weights(LLAMA), IDS)) > 100 * ATOL


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_kv_buffers_carry_over_between_passes(name: str, tmp_path: Path) -> None:
    """Prefill, single-token steps and a second chunk, each pass reading the previous
    pass's present.N buffers as its past: the same logits as one pass."""
    arch = ARCHS[name]
    out = imported(ck.write_hf(tmp_path / "src", arch, weights(arch)), tmp_path / "out")
    got = ck.run_imported(out, IDS, chunks=[7, 1, 1, 1, 10, 1, 3])
    assert_logits(got, ck.forward(arch, weights(arch), IDS))


# -- GGUF files -----------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16], ids=lambda q: q.name)
@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_gguf_float_matches_numpy(name: str, qtype: QT, dtype: str, tmp_path: Path) -> None:
    arch = ARCHS[name]
    src = ck.write_gguf(tmp_path / f"tiny-{name}.gguf", arch, weights(arch), qtype)
    out = imported(src.path, tmp_path / "out", dtype)
    assert_logits(ck.run_imported(out, IDS), ck.forward(arch, src.weights, IDS))
    assert "MatMulNBits" not in op_counts(out)  # float tensors stay float, even with auto


def test_gguf_llama_permutation_is_undone(tmp_path: Path) -> None:
    """llama.cpp stores Llama's Q and K rows permuted; the import puts them back, so a
    GGUF and the Hugging Face folder it was converted from give the same logits."""
    w = weights(LLAMA)
    for key in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        heads = LLAMA.heads if "q_proj" in key else LLAMA.kv_heads
        assert np.array_equal(ck.llama_unpermute(ck.llama_permute(w[key], heads), heads), w[key])
        assert not np.array_equal(ck.llama_permute(w[key], heads), w[key])
    src = ck.write_gguf(tmp_path / "tiny.gguf", LLAMA, w)
    got = ck.run_imported(imported(src.path, tmp_path / "gguf"), IDS)
    hf = ck.run_imported(imported(ck.write_hf(tmp_path / "hf", LLAMA, w), tmp_path / "hf-out"), IDS)
    assert_logits(got, ck.forward(LLAMA, w, IDS))
    assert_logits(got, hf)
    # the negative check: the rows as stored (permutation not undone) compute another model
    wrong = ck.forward(LLAMA, src.stored, IDS)
    assert max_err(got, wrong) > 1.0
    rel = np.sqrt(np.mean((got - wrong) ** 2) / np.mean(wrong**2))
    assert rel > 0.3
    assert (got.argmax(-1) != wrong.argmax(-1)).mean() > 0.3


def test_gguf_qwen2_is_not_permuted(tmp_path: Path) -> None:
    """Qwen2's rows are stored as they are (only llama's converter permutes)."""
    src = ck.write_gguf(tmp_path / "tiny.gguf", QWEN2, weights(QWEN2))
    for key, value in src.stored.items():
        assert np.array_equal(value, weights(QWEN2)[key])
    hf = imported(ck.write_hf(tmp_path / "hf", QWEN2, weights(QWEN2)), tmp_path / "hf-out")
    assert_logits(
        ck.run_imported(imported(src.path, tmp_path / "out"), IDS), ck.run_imported(hf, IDS)
    )


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_gguf_blocks_dequantized_match_numpy(name: str, qtype: QT, tmp_path: Path) -> None:
    """dtype float32: every block dequantized exactly as gguf.quants.dequantize does."""
    arch = ARCHS[name]
    src = ck.write_gguf(tmp_path / "tiny.gguf", arch, weights(arch), qtype)
    out = imported(src.path, tmp_path / "out", "float32")
    assert "MatMulNBits" not in op_counts(out)
    assert_logits(ck.run_imported(out, IDS), ck.forward(arch, src.weights, IDS))


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_gguf_blocks_kept(name: str, qtype: QT, tmp_path: Path) -> None:
    arch = ARCHS[name]
    src = ck.write_gguf(tmp_path / "tiny.gguf", arch, weights(arch), qtype)
    out = imported(src.path, tmp_path / "out", "auto")
    ref = ck.forward(arch, src.weights, IDS)
    # the blocks are kept: q|k|v, o, gate|up and down per layer, and the head; the
    # embedding is gathered from blocks (Q4_1's offsets gathered beside them)
    ops = op_counts(out)
    assert ops["MatMulNBits"] == 4 * arch.layers + 1
    assert ops["GatherBlockQuantized"] == 1
    assert ops.get("Gather", 0) == (qtype == QT.Q4_1)

    # float activations: the repacked blocks are the stored values exactly
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    for node in model.graph.node:
        for attr in node.attribute:
            if attr.name == "accuracy_level":
                attr.i = 1
    onnx.save(model, str(out / "float_activations.onnx"))  # beside its model.onnx.data
    assert_logits(ck.run_imported(out, IDS, model="float_activations.onnx"), ref)

    # int8 activations (as imported): the looser bound of the module docstring
    got = ck.run_imported(out, IDS)
    rel_rms = float(np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref**2)))
    assert rel_rms < 8e-2
    assert max_err(got, ref) < 0.15 * float(np.abs(ref).max())
    best = got.argmax(-1)
    assert (best == ref.argmax(-1)).mean() >= 2 / 3
    top3 = np.argsort(-ref, axis=-1)[:, :3]
    assert all(best[i] in top3[i] for i in range(len(IDS)))


def test_gguf_tokenizer_matches_the_hf_one(tmp_path: Path) -> None:
    """The tokenizer rebuilt from GGUF metadata encodes as the folder's tokenizer.json."""
    src = ck.write_gguf(tmp_path / "tiny.gguf", QWEN2, weights(QWEN2))
    out = imported(src.path, tmp_path / "out")
    rebuilt = Tokenizer.from_file(str(out / "tokenizer.json"))
    original = Tokenizer.from_str(ck.tokenizer_json())
    text = "<|im_start|>user\nthe cat sat and is in there; héllo 42!<|im_end|>\n"
    assert rebuilt.encode(text).ids == original.encode(text).ids
    assert rebuilt.get_vocab_size() == ck.VOCAB
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["eos_token_id"], cfg["bos_token_id"]) == ([ck.EOS_ID], ck.BOS_ID)
    assert (out / "chat_template.jinja").read_text() == ck.CHAT_TEMPLATE


# -- refusals and broken sources ------------------------------------------------------------

HF_REFUSALS: list[tuple[dict[str, Any], str]] = [
    ({"model_type": "gpt2"}, "model_type 'gpt2'"),
    ({"model_type": "mixtral", "num_local_experts": 8}, "model_type 'mixtral'"),
    ({"num_local_experts": 8, "num_experts_per_tok": 2}, "mixture-of-experts"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope scaling 'dynamic'"),
    ({"hidden_act": "gelu"}, "activation 'gelu'"),
    ({"attention_bias": True}, "biases"),
    ({"mlp_bias": True}, "biases"),
]


@pytest.mark.parametrize(("change", "message"), HF_REFUSALS, ids=lambda x: str(x)[:30])
def test_hf_refusals(change: dict[str, Any], message: str, tmp_path: Path) -> None:
    config = ck.hf_config(MISTRAL) | change
    src = ck.write_hf(tmp_path / "src", MISTRAL, weights(MISTRAL), config=config)
    with pytest.raises(UnsupportedModel, match=message):
        imported(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


GGUF_REFUSALS: list[tuple[str, dict[str, int | float | str], str]] = [
    ("phi2", {}, "GGUF architecture 'phi2'"),
    ("llama", {"rope.dimension_count": 8}, r"partial rotary \(8 of 16"),
    ("llama", {"expert_count": 8, "expert_used_count": 2}, "mixture-of-experts"),
    ("qwen2", {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}, "rope scaling 'yarn'"),
]


@pytest.mark.parametrize(("arch", "extra", "message"), GGUF_REFUSALS, ids=lambda x: str(x)[:30])
def test_gguf_refusals(
    arch: str, extra: dict[str, int | float | str], message: str, tmp_path: Path
) -> None:
    base = QWEN2 if arch == "qwen2" else LLAMA
    src = ck.write_gguf(tmp_path / "x.gguf", base, weights(base), gguf_arch=arch, extra=extra)
    with pytest.raises(UnsupportedModel, match=message):
        imported(src.path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, int]:
    """A valid Q4_0 GGUF's bytes and the offset of its tensor data."""
    path = tmp_path_factory.mktemp("good") / "tiny.gguf"
    ck.write_gguf(path, QWEN2, weights(QWEN2), QT.Q4_0)
    return path.read_bytes(), int(gguf.GGUFReader(str(path)).data_offset)


@pytest.mark.parametrize("where", ["empty", "magic", "kv", "tensor_info", "data", "last_byte"])
def test_truncated_gguf_is_refused_clearly(
    where: str, good_gguf: tuple[bytes, int], tmp_path: Path
) -> None:
    data, offset = good_gguf
    cut = {
        "empty": 0,
        "magic": 3,
        "kv": 35,  # inside the first key-value pair
        "tensor_info": offset - 300,
        "data": offset + 1000,
        "last_byte": len(data) - 1,
    }[where]
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:cut])
    with pytest.raises(ConfigError, match="GGUF"):
        imported(path, tmp_path / "out")


def test_corrupt_gguf_header_is_refused_clearly(
    good_gguf: tuple[bytes, int], tmp_path: Path
) -> None:
    """Single bytes of the header overwritten: refused (UnsupportedModel or ConfigError), or
    imported when the byte did not matter; never another exception."""
    data, offset = good_gguf
    rng = np.random.default_rng(3)
    outcomes: Counter[str] = Counter()
    for i, at in enumerate(rng.integers(4, offset, 40)):
        broken = bytearray(data)
        broken[int(at)] = (broken[int(at)] + 1 + int(rng.integers(0, 255))) % 256
        path = tmp_path / f"bad{i}.gguf"
        path.write_bytes(bytes(broken))
        try:
            with np.errstate(all="ignore"):  # a scale read from elsewhere may be NaN
                imported(path, tmp_path / f"out{i}")
            outcomes["imported"] += 1
        except ConfigError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 0


def test_broken_hf_folders_are_refused_clearly(tmp_path: Path) -> None:
    good = ck.write_hf(tmp_path / "good", LLAMA, weights(LLAMA))

    def variant(name: str) -> Path:
        return Path(shutil.copytree(good, tmp_path / name))

    no_weights = variant("no-weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(UnsupportedModel, match=r"no \*\.safetensors"):
        imported(no_weights, tmp_path / "o1")
    nonsense = variant("nonsense-weights")
    (nonsense / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(UnsupportedModel, match="not a readable safetensors file"):
        imported(nonsense, tmp_path / "o2")
    bad_config = variant("bad-config")
    (bad_config / "config.json").write_text("{not json")
    with pytest.raises(UnsupportedModel, match=r"config\.json"):
        imported(bad_config, tmp_path / "o3")
    no_tokenizer = variant("no-tokenizer")
    (no_tokenizer / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match=r"tokenizer\.json"):
        imported(no_tokenizer, tmp_path / "o4")
    missing = variant("missing-tensor")
    held = dict(weights(LLAMA))
    del held["model.layers.1.mlp.up_proj.weight"]
    save_file(held, str(missing / "model.safetensors"))
    with pytest.raises(UnsupportedModel, match=re.escape("model.layers.1.mlp.up_proj.weight")):
        imported(missing, tmp_path / "o5")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UnsupportedModel, match=r"neither a \.gguf file nor"):
        imported(empty, tmp_path / "o6")
    not_gguf = tmp_path / "model.bin"
    not_gguf.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(UnsupportedModel, match="not a GGUF file"):
        imported(not_gguf, tmp_path / "o7")
    for i in range(1, 8):
        assert not (tmp_path / f"o{i}").exists()


@pytest.mark.parametrize("how", ["cut-header", "garbage-header", "list-header", "cut-data"])
def test_corrupt_safetensors_is_refused_clearly(how: str, tmp_path: Path) -> None:
    src = ck.write_hf(tmp_path / "src", LLAMA, weights(LLAMA))
    data = (src / "model.safetensors").read_bytes()
    size = int.from_bytes(data[:8], "little")
    broken = {
        "cut-header": data[: 8 + size // 2],
        "garbage-header": data[:8] + b"x" * size + data[8 + size :],
        "list-header": (4).to_bytes(8, "little") + b"[1] ",
        "cut-data": data[: 8 + size + 1000],
    }[how]
    (src / "model.safetensors").write_bytes(broken)
    with pytest.raises(ConfigError, match="safetensors"):
        imported(src, tmp_path / "out")


# -- block formats: bit-exact dequantization, exact repacking, quantize() bounds -----------


def _raw_blocks(qtype: QT, rows: int, blocks: int, seed: int, kind: str) -> Any:
    """Raw GGUF blocks [rows, bytes]: arbitrary bytes (any float16 scale, NaN and inf
    included), or gguf's own quantization of Gaussian weights of a random scale."""
    rng = np.random.default_rng(seed)
    if kind == "bytes":
        size = quant.BLOCK_BYTES[int(qtype)]
        return rng.integers(0, 256, (rows, blocks * size), dtype=np.uint8)
    scale = 10.0 ** rng.uniform(-4, 3)
    w = (rng.standard_normal((rows, blocks * quant.BLOCK)) * scale).astype(np.float32)
    w += np.float32(scale * rng.uniform(-2, 2))  # an offset, which Q4_1 keeps
    return gguf.quants.quantize(w, qtype)


block_cases = st.tuples(
    st.sampled_from(BLOCK_TYPES),
    st.integers(1, 4),
    st.integers(1, 6),
    st.integers(0, 2**32 - 1),
)


@settings(derandomize=True, max_examples=150, deadline=None)
@given(block_cases, st.sampled_from(["bytes", "quantized"]))
def test_dequantize_is_bit_exact(case: tuple[QT, int, int, int], kind: str) -> None:
    qtype, rows, blocks, seed = case
    raw = _raw_blocks(qtype, rows, blocks, seed, kind)
    with np.errstate(all="ignore"):  # inf * 0 in a block of random bytes
        ours = quant.dequantize(raw, int(qtype))
        theirs = np.asarray(gguf.quants.dequantize(raw, qtype), np.float32)
    assert ours.dtype == np.float32 and ours.shape == theirs.shape == (rows, blocks * 32)
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


@settings(derandomize=True, max_examples=150, deadline=None)
@given(block_cases)
def test_kept_blocks_hold_the_same_values(case: tuple[QT, int, int, int]) -> None:
    """to_matrix repacks without rounding: Q8_0 and Q4_0 bit for bit; Q4_1's
    ``d * q + m`` as ``d * (q - 8) + (m + 8d)`` within a few float32 roundings."""
    qtype, rows, blocks, seed = case
    raw = _raw_blocks(qtype, rows, blocks, seed, "quantized")
    theirs = np.asarray(gguf.quants.dequantize(raw, qtype), np.float32)
    m = quant.to_matrix(raw, int(qtype))
    assert (m.n, m.k, m.block) == (rows, blocks * 32, 32)
    ours = m.dequantize()
    if qtype != QT.Q4_1:
        assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
        return
    parts = raw.reshape(rows, blocks, 20)
    d = np.ascontiguousarray(parts[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
    mins = np.ascontiguousarray(parts[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
    bound = 4 * np.finfo(np.float32).eps * (24 * np.abs(d) + np.abs(mins))
    err = np.abs(ours - theirs).reshape(rows, blocks, 32)
    assert (err <= bound[..., None]).all()


@settings(derandomize=True, max_examples=150, deadline=None)
@given(
    st.sampled_from([8, 4]),
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(0, 2**32 - 1),
    st.sampled_from(["gaussian", "outlier", "constant", "zeros", "offset"]),
)
def test_quantize_round_trip_bounds(
    bits: int, rows: int, blocks: int, seed: int, kind: str
) -> None:
    """8 bits: error <= d/2 with d = absmax/127; 4 bits: error <= d/2 with d = (max-min)/15;
    plus float32 rounding (a few ulp of the block's magnitude)."""
    rng = np.random.default_rng(seed)
    scale = 10.0 ** rng.uniform(-6, 4)  # (blocks below ~1e-36 are a reported edge case)
    w = rng.standard_normal((rows, blocks * 32)) * scale
    if kind == "outlier":
        w[:, ::32] *= 50
    elif kind == "constant":
        w[:] = scale
    elif kind == "zeros":
        w[:] = 0
    elif kind == "offset":
        w += 5 * scale
    w32 = w.astype(np.float32)
    m = quant.quantize(w32, bits)
    assert (m.bits, m.n, m.k) == (bits, rows, blocks * 32)
    err = np.abs(m.dequantize() - w32).reshape(rows, blocks, 32)
    x = w32.reshape(rows, blocks, 32)
    if bits == 8:
        d = np.abs(x).max(axis=-1) / 127
        assert np.allclose(m.scales, d, rtol=1e-6, atol=0)
    else:
        d = (x.max(axis=-1) - x.min(axis=-1)) / 15
        assert np.allclose(m.scales, d, rtol=1e-6, atol=0)
    slack = 8 * np.finfo(np.float32).eps * (np.abs(x).max(axis=-1) + 16 * d)
    assert (err <= (d / 2 + slack)[..., None]).all()


# -- determinism ----------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["gguf-q4_1", "hf"])
def test_import_is_deterministic(source: str, tmp_path: Path) -> None:
    if source == "hf":
        src = ck.write_hf(tmp_path / "tiny", QWEN2, weights(QWEN2))
        dtype, concepts = "float32", False
    else:
        src = ck.write_gguf(tmp_path / "tiny.gguf", LLAMA, weights(LLAMA), QT.Q4_1).path
        dtype, concepts = "auto", True
    a = import_model(src, tmp_path / "a", dtype=dtype, concepts=concepts).folder
    b = import_model(src, tmp_path / "b", dtype=dtype, concepts=concepts).folder
    names = ["model.onnx", "model.onnx.data", "config.json", "tokenizer.json"]
    if concepts:
        names.append("readout_concepts.json")
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    if concepts:
        doc = json.loads((a / "readout_concepts.json").read_text())
        assert doc["hidden_size"] == LLAMA.hidden and doc["layers"] == [1, 2]
