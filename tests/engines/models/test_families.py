"""Llama 3, Qwen3, Gemma 2, Gemma 3, Phi-3 and Mistral against an independent numpy forward pass.

Each model (tests/helpers/families.py) is a tiny random checkpoint written here as a
Hugging Face folder and as an F32 GGUF file as llama.cpp's converter writes it, imported
with :func:`import_model` in both attention variants (``gqa``, ``masked``) and run through
onnxruntime; its logits at every position must be those of the numpy forward pass within
1e-4 (float32 against float64: the same bound and reasoning as test_architectures.py). The
24-token sequence is three times the sliding window (8) of the windowed models, and a
chunked run (prefill, single steps, a chunk across the window's edge) carries the KV
buffers between passes. Negative checks show that each feature moves the logits far more
than the tolerance (a soft cap, a window, a rope scaling left out would be caught).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessiontape.core.engine.interface import OutputOptions, SamplingParams
from sessiontape.core.errors import UnsupportedModel
from sessiontape.engines.models.arch import spec_from_gguf, spec_from_hf
from sessiontape.engines.onnx.importer import import_model
from tests.helpers import checkpoints as ck
from tests.helpers import families as fm
from tests.helpers.families import F64, Model

ATOL = 1e-4
QT = gguf.GGMLQuantizationType
IDS = [ck.BOS_ID, *(int(i) for i in np.random.default_rng(5).integers(0, ck.VOCAB, 23))]
CHUNKS = [7, 1, 1, 1, 10, 1, 3]

LLAMA3 = Model(
    "llama",
    seed=21,
    rope_theta=500000.0,
    eps=1e-5,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
)
LLAMA3_TIED = replace(LLAMA3, seed=22, tied=True)
QWEN3 = Model("qwen3", seed=23, head_dim=32, rope_theta=1e6, tied=True)
GEMMA2 = Model(
    "gemma2",
    seed=24,
    hidden=48,
    head_dim=32,
    attn_softcap=3.0,
    final_softcap=1.0,
    sliding_window=8,
    tied=True,
)
GEMMA3 = Model(
    "gemma3_text",
    seed=25,
    layers=6,
    kv_heads=1,
    head_dim=32,
    rope_theta=1e6,
    rope_scaling={"rope_type": "linear", "factor": 8.0},
    sliding_window=8,
    tied=True,
)
PHI3 = Model(
    "phi3",
    seed=26,
    context=64,
    original_context=16,  # positions 16..23 of IDS take the long factors
    rope_scaling={
        "type": "longrope",
        "short_factor": [1.0, 1.1, 1.3, 1.7, 2.2, 3.0, 4.1, 5.5],
        "long_factor": [1.5, 2.0, 3.0, 4.5, 6.0, 8.0, 11.0, 15.0],
    },
    sliding_window=2047,  # longer than the context: never applies
)
PHI3_WINDOW = Model("phi3", seed=27, sliding_window=8)
MISTRAL = Model("mistral", seed=28, rope_theta=1e6, eps=1e-5, sliding_window=8)
MODELS = {
    "llama3": LLAMA3,
    "llama3-tied": LLAMA3_TIED,
    "qwen3": QWEN3,
    "gemma2": GEMMA2,
    "gemma3": GEMMA3,
    "phi3-longrope": PHI3,
    "phi3-window": PHI3_WINDOW,
    "mistral": MISTRAL,
}
_WEIGHTS: dict[int, fm.Weights] = {}


def weights(m: Model) -> fm.Weights:
    if m.seed not in _WEIGHTS:
        _WEIGHTS[m.seed] = fm.random_weights(m)
    return _WEIGHTS[m.seed]


def source(m: Model, fmt: str, tmp: Path) -> Path:
    if fmt == "hf":
        return fm.write_hf(tmp / "hf", m, weights(m))
    return fm.write_gguf(tmp / "model.gguf", m, weights(m))


def imported(src: Path, out: Path, attention: str = "gqa", dtype: str = "float32") -> Path:
    return import_model(src, out, dtype, concepts=False, attention=attention).folder


def assert_logits(got: F64, ref: F64, atol: float = ATOL) -> None:
    assert got.shape == ref.shape == (len(IDS), ck.VOCAB)
    worst = np.abs(got - ref).max(axis=-1)
    assert worst.max() <= atol, f"max |diff| per position {np.round(worst, 7).tolist()}"


@pytest.mark.parametrize("attention", ["gqa", "masked"])
@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("name", list(MODELS))
def test_logits_match_numpy(name: str, fmt: str, attention: str, tmp_path: Path) -> None:
    m = MODELS[name]
    out = imported(source(m, fmt, tmp_path), tmp_path / "out", attention)
    ref = fm.forward(m, weights(m), IDS)
    assert_logits(ck.run_imported(out, IDS), ref)
    if (m.sliding_window is not None and m.sliding_window < len(IDS)) or m.original_context:
        # prefill, steps and a chunk across the window's edge (Phi-3: across the original
        # length, where the long factors start), KV buffers carried over
        assert_logits(ck.run_imported(out, IDS, chunks=CHUNKS), ref)


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0], ids=lambda q: q.name)
@pytest.mark.parametrize("name", ["phi3-window", "gemma3", "llama3"])
def test_gguf_blocks(name: str, qtype: QT, tmp_path: Path) -> None:
    """Block matrices (Phi-3's fused ones sliced by rows as blocks): dequantized on import
    (float32), and kept as blocks (auto: MatMulNBits, the embedding read as 8-bit blocks
    and then scaled for Gemma), computed with float activations (accuracy_level 1, as
    test_architectures.py checks the repacking): the logits of the values the file holds."""
    m = MODELS[name]
    src = fm.write_gguf(tmp_path / "m.gguf", m, weights(m), qtype=qtype)
    ref = fm.forward(m, fm.quantized(weights(m), qtype), IDS)
    assert_logits(ck.run_imported(imported(src, tmp_path / "f32", "masked"), IDS), ref)
    kept = imported(src, tmp_path / "auto", "gqa", "auto")
    model = onnx.load(str(kept / "model.onnx"), load_external_data=False)
    ops = {n.op_type for n in model.graph.node}
    assert {"MatMulNBits", "GatherBlockQuantized"} <= ops
    for node in model.graph.node:
        for attr in node.attribute:
            if attr.name == "accuracy_level":
                attr.i = 1
    onnx.save(model, str(kept / "float_activations.onnx"))
    assert_logits(ck.run_imported(kept, IDS, model="float_activations.onnx"), ref)


#: Gemma 3 270M's shapes in small (every input a multiple of 256, K-quants' super-block)
GEMMA3_K = replace(
    GEMMA3, seed=29, hidden=256, heads=4, head_dim=64, intermediate=512, sliding_window=8
)


def gemma3_k_type(name: str) -> QT | None:
    """The block types of Gemma 3 270M's Q4_K_M file, per matrix (with Llama's Q4_K q and k
    beside a Q6_K v on one layer, so that a fused q|k|v mixes formats)."""
    layer = int(name.split(".")[2]) if ".layers." in name else -1
    if name == "model.embed_tokens.weight":
        return QT.Q8_0
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        return QT.Q4_K if layer == 1 else QT.Q5_0
    if name.endswith("v_proj.weight"):
        return QT.Q6_K if layer == 1 else QT.Q8_0 if layer % 2 else QT.Q5_0
    if name.endswith("o_proj.weight"):
        return QT.Q4_K
    if name.endswith("down_proj.weight"):
        return QT.Q6_K if layer in (0, 5) else QT.Q4_K
    return QT.Q5_0  # gate, up


def test_gemma3_k_quant_mix(tmp_path: Path) -> None:
    """A Gemma 3 GGUF mixing blocks per tensor as the real ``Q4_K_M`` file does (Q5_0, Q8_0,
    Q4_K, Q6_K; a Q8_0 tied embedding), past its sliding window: the float32 import and the
    kept blocks (float activations) compute the logits of the values the file holds, in one
    pass and in chunks."""
    m = GEMMA3_K
    blocks, held = fm.mixed_blocks(m, weights(m), gemma3_k_type)
    src = fm.write_gguf(tmp_path / "m.gguf", m, weights(m), blocks=blocks)
    ref = fm.forward(m, held, IDS)
    f32 = imported(src, tmp_path / "f32", "masked")
    assert_logits(ck.run_imported(f32, IDS), ref)
    kept = imported(src, tmp_path / "auto", "gqa", "auto")
    model = onnx.load(str(kept / "model.onnx"), load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    # qkv, o, gate|up, down per layer and the head; layer 1's 4-bit q|k and 8-bit v apart
    assert ops.count("MatMulNBits") == 4 * m.layers + 2 and "GatherBlockQuantized" in ops
    for node in model.graph.node:
        for attr in node.attribute:
            if attr.name == "accuracy_level":
                attr.i = 1
    onnx.save(model, str(kept / "float_activations.onnx"))
    for chunks in (None, CHUNKS):
        got = ck.run_imported(kept, IDS, model="float_activations.onnx", chunks=chunks)
        assert_logits(got, ref)


def test_spec_facts(tmp_path: Path) -> None:
    """What config.json records of each family (the features the graph was built with)."""

    def cfg(m: Model, fmt: str) -> dict[str, Any]:
        where = tmp_path / f"{m.seed}-{fmt}"
        where.mkdir()
        folder = imported(source(m, fmt, where), where / "out")
        return dict(json.loads((folder / "config.json").read_text()))

    for fmt in ("hf", "gguf"):
        g3 = cfg(GEMMA3, fmt)
        assert (g3["sliding_window"], g3["local_layers"]) == (8, [0, 1, 2, 3, 4])
        assert (g3["local_rope_theta"], g3["rope_theta"]) == (10000.0, 1e6)
        assert g3["qk_norm"] and g3["post_norms"] and g3["activation"] == "gelu_tanh"
        assert g3["embed_scale"] == pytest.approx(8.0) and g3["final_softcap"] is None
        g2 = cfg(GEMMA2, fmt)
        assert (g2["sliding_window"], g2["local_layers"]) == (8, [0])
        assert (g2["attn_softcap"], g2["final_softcap"]) == (3.0, 1.0)
        assert not g2["qk_norm"] and g2["local_rope_theta"] is None
        phi = cfg(PHI3, fmt)
        assert phi["max_length"] == 64  # long-rope: the whole context, long factors from 16
        assert phi["rope_long_from"] == 16
        assert PHI3.rope_scaling is not None
        assert phi["rope_long_factors"] == PHI3.rope_scaling["long_factor"]
        assert phi["sliding_window"] == 0  # 2047 covers the context
        assert phi["rope_attention_factor"] == pytest.approx(1.5**0.5, abs=1e-6)
        q3 = cfg(QWEN3, fmt)
        assert q3["qk_norm"] and not q3["qkv_bias"] and q3["head_dim"] == 32
        mistral = cfg(MISTRAL, fmt)
        assert (mistral["sliding_window"], mistral["local_layers"]) == (8, [0, 1])
        assert mistral["max_length"] == MISTRAL.context


def test_the_features_move_the_logits() -> None:
    """Each feature the references compute changes the logits by far more than ATOL, so a
    graph that left one out could not pass test_logits_match_numpy."""

    def moved(m: Model, other: Model | None = None, **kw: Any) -> float:
        base = fm.forward(m, weights(m), IDS)
        alt = fm.forward(other or m, weights(m), IDS, **kw)
        return float(np.abs(base - alt).max())

    for m in (GEMMA2, GEMMA3, MISTRAL, PHI3_WINDOW):
        assert moved(m, window=False) > 100 * ATOL, m.kind
    assert moved(GEMMA2, replace(GEMMA2, attn_softcap=None)) > 100 * ATOL
    assert moved(GEMMA2, replace(GEMMA2, final_softcap=None)) > 100 * ATOL
    assert moved(LLAMA3, replace(LLAMA3, rope_scaling=None)) > 100 * ATOL
    assert moved(GEMMA3, replace(GEMMA3, rope_scaling=None)) > 100 * ATOL
    assert moved(GEMMA3, replace(GEMMA3, local_rope_theta=1e6)) > 100 * ATOL
    assert moved(PHI3, replace(PHI3, rope_scaling=None)) > 100 * ATOL
    assert PHI3.rope_scaling is not None
    short_only = {**PHI3.rope_scaling, "long_factor": PHI3.rope_scaling["short_factor"]}
    assert moved(PHI3, replace(PHI3, rope_scaling=short_only)) > 100 * ATOL
    assert moved(GEMMA2, replace(GEMMA2, query_pre_attn_scalar=24.0)) > 100 * ATOL


def test_gemma2_query_pre_attn_scalar_from_hf(tmp_path: Path) -> None:
    """A Hugging Face config's query_pre_attn_scalar scales the queries (a GGUF has no key
    for it: llama.cpp uses head_dim, or hidden / heads for the 27B models)."""
    m = replace(GEMMA2, query_pre_attn_scalar=24.0)
    out = imported(fm.write_hf(tmp_path / "hf", m, weights(m)), tmp_path / "out")
    assert_logits(ck.run_imported(out, IDS), fm.forward(m, weights(m), IDS))


def test_gemma_config_defaults(tmp_path: Path) -> None:
    """Keys a Gemma config leaves out take transformers' defaults (Gemma 2: soft caps 50 and
    30; both: query_pre_attn_scalar 256), not "none"."""
    m = replace(GEMMA2, attn_softcap=50.0, final_softcap=30.0, query_pre_attn_scalar=256.0)
    src = fm.write_hf(tmp_path / "hf", m, weights(GEMMA2))
    cfg = fm.hf_config(m)
    for key in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
        del cfg[key]
    (src / "config.json").write_text(json.dumps(cfg))
    out = imported(src, tmp_path / "out")
    assert_logits(ck.run_imported(out, IDS), fm.forward(m, weights(GEMMA2), IDS))
    facts = json.loads((out / "config.json").read_text())
    assert (facts["attn_softcap"], facts["final_softcap"]) == (50.0, 30.0)
    assert facts["query_scale"] == pytest.approx(1 / 16)


def test_gemma3_multimodal_checkpoint_reads_its_language_model(tmp_path: Path) -> None:
    """Gemma3ForConditionalGeneration: the text model's config under text_config, its
    tensors under language_model.model.*; the vision tower's are not read."""
    w = {"language_model." + k: v for k, v in weights(GEMMA3).items()}
    w["vision_tower.vision_model.embeddings.patch_embedding.weight"] = np.ones((4, 4), np.float32)
    folder = fm.write_hf(tmp_path / "mm", GEMMA3, w)
    text = fm.hf_config(GEMMA3)
    config = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]}
    config |= {"text_config": text, "vision_config": {"hidden_size": 4}}
    (folder / "config.json").write_text(json.dumps(config))
    out = imported(folder, tmp_path / "out")
    assert_logits(ck.run_imported(out, IDS), fm.forward(GEMMA3, weights(GEMMA3), IDS))


def test_engine_generates_past_the_window(tmp_path: Path) -> None:
    """Through the engine, greedy: the tokens after a prompt longer than Gemma 3's window are
    the numpy reference's argmax continuation, with the masked graph batching two sessions,
    the GQA graph alone, and either graph in fixed-shape passes (the static layout's fixed
    capacity and row count, as on CUDA)."""
    from sessiontape.engines.onnx.engine import OnnxEngine

    m = GEMMA3
    prompt = IDS[:20]
    ids = list(prompt)
    for _ in range(8):
        ids.append(int(fm.forward(m, weights(m), ids)[-1].argmax()))
    want = ids[len(prompt) :]
    src = fm.write_gguf(tmp_path / "g3.gguf", m, weights(m))
    greedy = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=())
    folders = {a: imported(src, tmp_path / a, a) for a in ("masked", "gqa")}
    runs: list[tuple[str, dict[str, Any]]] = [
        ("masked", {}),
        ("gqa", {}),
        ("masked", {"pass_rows": 4, "kv_capacity": 64}),
        ("gqa", {"pass_rows": 4, "kv_capacity": 64}),
    ]
    for attention, options in runs:
        eng = OnnxEngine(model_dir=folders[attention], intra_op_threads=1, **options)

        async def go(key: str, eng: OnnxEngine = eng) -> list[int]:
            steps = eng.generate(key, list(prompt), greedy, OutputOptions())
            return [s.token_id async for s in steps if not s.is_prefill]

        async def both(eng: OnnxEngine = eng) -> list[list[int]]:
            return list(await asyncio.gather(go("a"), go("b")))

        try:
            got = asyncio.run(both())
        finally:
            asyncio.run(eng.aclose())
        assert got == [want, want], (attention, options)


def test_rope_parameters_of_newer_configs(tmp_path: Path) -> None:
    """transformers' newer config spelling (``rope_parameters``, per layer type for Gemma 3)
    reads as the older one (``rope_theta``, ``rope_scaling``, ``rope_local_base_freq``)."""
    for m, params in (
        (LLAMA3, {**dict(LLAMA3.rope_scaling or {}), "rope_theta": LLAMA3.rope_theta}),
        (
            GEMMA3,
            {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ):
        src = fm.write_hf(tmp_path / f"hf{m.seed}", m, weights(m))
        cfg = fm.hf_config(m)
        for key in ("rope_theta", "rope_scaling", "rope_local_base_freq"):
            cfg.pop(key, None)
        (src / "config.json").write_text(json.dumps(cfg | {"rope_parameters": params}))
        out = imported(src, tmp_path / f"out{m.seed}")
        assert_logits(ck.run_imported(out, IDS), fm.forward(m, weights(m), IDS))


# -- refusals: by name, from the header or config alone ---------------------------------------

HF_REFUSALS: list[tuple[Model, dict[str, Any], str]] = [
    (GEMMA3, {"use_bidirectional_attention": True}, "bidirectional attention"),
    (PHI3_WINDOW, {"partial_rotary_factor": 0.75}, r"partial rotary \(factor 0.75\)"),
    (PHI3_WINDOW, {"rope_scaling": {"type": "longrope", "short_factor": [1.0]}}, "long factors"),
    (GEMMA2, {"hidden_activation": "gelu"}, "activation 'gelu'"),
    (QWEN3, {"model_type": "qwen3_moe", "num_experts": 8}, "model_type 'qwen3_moe'"),
    (QWEN3, {"num_experts": 8}, "mixture-of-experts"),
    (GEMMA3, {"model_type": "gemma3n"}, "model_type 'gemma3n'"),
    (LLAMA3, {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn'"),
    (GEMMA3, {"layer_types": ["chunked_attention"] * 6}, "layer_types"),
]


@pytest.mark.parametrize(("m", "change", "message"), HF_REFUSALS, ids=lambda x: str(x)[:24])
def test_hf_refusals(m: Model, change: dict[str, Any], message: str, tmp_path: Path) -> None:
    src = fm.write_hf(tmp_path / "src", m, weights(m))
    (src / "config.json").write_text(json.dumps(fm.hf_config(m) | change))
    with pytest.raises(UnsupportedModel, match=message):
        imported(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("arch", "message"),
    [
        ("gemma", "GGUF architecture 'gemma'"),
        ("gemma3n", "GGUF architecture 'gemma3n'"),
        ("qwen3moe", "GGUF architecture 'qwen3moe'"),
        ("phi2", "GGUF architecture 'phi2'"),
        ("llama4", "GGUF architecture 'llama4'"),
    ],
)
def test_gguf_refusals(arch: str, message: str, tmp_path: Path) -> None:
    path = fm.write_gguf(tmp_path / "x.gguf", QWEN3, weights(QWEN3), gguf_arch=arch)
    with pytest.raises(UnsupportedModel, match=message):
        imported(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("attention", ["gqa", "masked"])
@pytest.mark.parametrize("name", ["gemma2", "gemma3", "qwen3", "phi3-longrope"])
def test_float16_graph(name: str, attention: str, tmp_path: Path) -> None:
    """The float16 graph (meant for CUDA; the CPU runs it too): every operator the new
    features add runs in float16, and the logits stay near the float64 reference (float16
    rounding of weights, activations and KV: measured 0.1% to 0.6% of the logits' range)."""
    m = MODELS[name]
    src = fm.write_gguf(tmp_path / "m.gguf", m, weights(m))
    got = ck.run_imported(imported(src, tmp_path / "out", attention, "float16"), IDS)
    ref = fm.forward(m, weights(m), IDS)
    assert np.abs(got - ref).max() < 0.02 * np.abs(ref).max()
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


# -- malformed headers and configs: refused by name, never another exception ----------------

JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.integers(-3, 3), max_size=4),
    st.dictionaries(st.sampled_from(["type", "factor", "rope_type"]), st.integers(-2, 2)),
)


@settings(derandomize=True, max_examples=300, deadline=None)
@given(
    st.sampled_from(["llama3", "qwen3", "gemma2", "gemma3", "phi3-longrope", "mistral"]),
    st.data(),
)
def test_malformed_values_are_refused_clearly(name: str, data: st.DataObject) -> None:
    """A config.json or GGUF header with values of any type or sign in its keys: the spec
    is read, or refused with UnsupportedModel; never another exception."""
    m = MODELS[name]
    config = fm.hf_config(m)
    meta: dict[str, Any] = {"general.architecture": fm.GGUF_ARCH[m.kind], **fm.gguf_meta(m)}
    for doc in (config, meta):
        for key in data.draw(st.lists(st.sampled_from(sorted(doc)), min_size=1, max_size=3)):
            doc[key] = data.draw(JUNK)
    for read in (lambda: spec_from_hf(config, "x"), lambda: spec_from_gguf(meta, "x")):
        try:
            spec = read()[0]
        except UnsupportedModel:
            continue
        assert spec.layers > 0 and spec.heads % spec.kv_heads == 0
