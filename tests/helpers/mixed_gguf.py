"""Random GGUF blocks of every format, and a small Qwen2-shaped GGUF mixing them per tensor
(as llama.cpp's ``_K_M`` presets do), written with ``gguf.GGUFWriter`` and without a chat
template: tests/engines/models/test_gguf_blocks.py and test_family_templates.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np

from tests.helpers import checkpoints as ck

QT = gguf.GGMLQuantizationType
#: byte offsets of each format's float16 fields (d, and dmin or m)
HALF_FIELDS = {
    QT.Q4_0: (0,),
    QT.Q4_1: (0, 2),
    QT.Q5_0: (0,),
    QT.Q5_1: (0, 2),
    QT.Q8_0: (0,),
    QT.Q2_K: (80, 82),
    QT.Q3_K: (108,),
    QT.Q4_K: (0, 2),
    QT.Q5_K: (0, 2),
    QT.Q6_K: (208,),
    QT.IQ4_NL: (0,),
    QT.IQ4_XS: (0,),
}


def random_blocks(
    qtype: QT, rows: int, cols: int, rng: np.random.Generator, kind: str = "finite"
) -> Any:
    """Raw blocks [rows, bytes] of ``rows`` x ``cols`` weights."""
    values, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // values * size), dtype=np.uint8)
    if kind == "finite":
        blocks = raw.reshape(-1, size)
        for at in HALF_FIELDS[qtype]:
            half = rng.standard_normal(len(blocks)) * 10.0 ** rng.uniform(-5, 2)
            blocks[:, at : at + 2] = half.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw


def scaled_blocks(qtype: QT, rows: int, cols: int, rng: np.random.Generator, std: float) -> Any:
    """Random blocks whose weights have about ``std``: every float16 field set to one value c
    (w is linear in d and dmin together), c chosen from the spread at c = 1."""
    raw = random_blocks(qtype, rows, cols, rng, "bytes")
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = raw.reshape(-1, size)

    def fill(c: float) -> None:
        for at in HALF_FIELDS[qtype]:
            blocks[:, at : at + 2] = np.array([c], np.float16).view(np.uint8)

    fill(1.0)
    spread = float(np.asarray(gguf.quants.dequantize(raw, qtype)).std()) or 1.0
    fill(std / spread)
    return raw


def gguf_dequantized(raw: Any, qtype: QT) -> Any:
    return np.asarray(gguf.quants.dequantize(raw, qtype), np.float32)


# -- a model that mixes formats per tensor --------------------------------------------------

MIXED = ck.Arch(
    "qwen2", seed=21, rope_theta=1e6, eps=1e-6, bias=True, hidden=256, heads=4, kv_heads=2,
    intermediate=512,
)  # fmt: skip
#: per layer: the format of each matrix (llama.cpp's Q4_K_M picks per tensor like this)
LAYER_TYPES = [
    {"q": QT.Q4_K, "k": QT.Q4_K, "v": QT.Q6_K, "o": QT.Q5_K, "g": QT.Q4_K, "u": QT.Q4_K},
    {"q": QT.Q5_0, "k": QT.Q8_0, "v": QT.Q5_1, "o": QT.Q3_K, "g": QT.Q2_K, "u": QT.Q2_K},
]
DOWN_TYPES = [QT.Q6_K, QT.IQ4_XS]
_HF = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "g": "mlp.gate_proj",
    "u": "mlp.up_proj",
}


def write_mixed(path: Path) -> dict[str, Any]:
    """The mixed model as a GGUF file; returns its weights dequantized, by transformers' names."""
    a = MIXED
    rng = np.random.default_rng(a.seed)
    hd = a.head_dim
    rows = {"q": a.heads * hd, "k": a.kv_heads * hd, "v": a.kv_heads * hd, "o": a.hidden}
    rows |= {"g": a.intermediate, "u": a.intermediate}
    held: dict[str, Any] = {}
    tensors: list[tuple[str, Any, QT | None]] = []

    def matrix(hf: str, gname: str, qtype: QT, n_out: int, n_in: int, gain: float = 1.0) -> None:
        raw = scaled_blocks(qtype, n_out, n_in, rng, gain / np.sqrt(n_in))
        held[hf] = gguf_dequantized(raw, qtype)
        tensors.append((gname, raw, qtype))

    def vector(hf: str, gname: str, values: Any) -> None:
        held[hf] = values.astype(np.float32)
        tensors.append((gname, held[hf], None))

    matrix("model.embed_tokens.weight", "token_embd.weight", QT.Q6_K, ck.VOCAB, a.hidden, 8.0)
    for i, types in enumerate(LAYER_TYPES):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        vector(p + "input_layernorm.weight", b + "attn_norm.weight", 1 + 0.2 * rng.random(a.hidden))
        for part, qtype in types.items():
            n_in = a.heads * hd if part == "o" else a.hidden
            gain = 1.5 if part in "qk" else 1.0
            gname = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output"}.get(part)
            gname = gname or {"g": "ffn_gate", "u": "ffn_up"}[part]
            matrix(p + _HF[part] + ".weight", b + gname + ".weight", qtype, rows[part], n_in, gain)
            if part in "qkv":
                bias = 0.5 * rng.standard_normal(rows[part])
                vector(p + _HF[part] + ".bias", b + f"attn_{part}.bias", bias)
        down = (p + "mlp.down_proj.weight", b + "ffn_down.weight")
        matrix(*down, DOWN_TYPES[i], a.hidden, a.intermediate)
        vector(
            p + "post_attention_layernorm.weight", b + "ffn_norm.weight", 1 + rng.random(a.hidden)
        )
    vector("model.norm.weight", "output_norm.weight", 1 + 0.2 * rng.random(a.hidden))
    matrix("lm_head.weight", "output.weight", QT.Q4_1, ck.VOCAB, a.hidden, 2.0)

    w = gguf.GGUFWriter(str(path), arch="qwen2")
    meta = {
        "context_length": a.context,
        "embedding_length": a.hidden,
        "block_count": a.layers,
        "feed_forward_length": a.intermediate,
        "attention.head_count": a.heads,
        "attention.head_count_kv": a.kv_heads,
    }
    for key, value in meta.items():
        w.add_uint32(f"qwen2.{key}", value)
    w.add_float32("qwen2.rope.freq_base", a.rope_theta)
    w.add_float32("qwen2.attention.layer_norm_rms_epsilon", a.eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(ck.TOKENS)
    w.add_token_types([ck.CONTROL if t in ck.SPECIALS else ck.NORMAL for t in ck.TOKENS])
    w.add_token_merges([f"{x} {y}" for x, y in ck.MERGES])
    w.add_eos_token_id(ck.EOS_ID)
    for name, arr, qtype in tensors:
        if qtype is None:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, arr, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held
