"""Tiny random checkpoints of Llama 3, Qwen3, Gemma 2, Gemma 3, Phi-3 and Mistral, written as a
Hugging Face folder or a GGUF file, and a float64 numpy forward pass over their weights: the
reference for tests/engines/models/test_families.py.

Nothing here imports the importer. The forward pass follows transformers' modeling files
(Llama's rope scaling ``llama3``, Qwen3's q/k norms, Gemma 2/3's scaled embedding, ``1 + w``
norms, post-norms, GELU-tanh, soft-capping, sliding windows and local rotary base,
Phi-3's fused matrices and long-rope factors), and the GGUF writer follows llama.cpp's
converter (Gemma norms stored as ``1 + w``, Llama's Q/K rows permuted, Phi-3's fused
``attn_qkv`` and ``ffn_up``, Llama 3's ``rope_freqs`` and Phi-3's ``rope_factors_*``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt
from safetensors.numpy import save_file

from tests.helpers import checkpoints as ck
from tests.helpers.mixed_gguf import gguf_dequantized, scaled_blocks

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
Weights = dict[str, F32]


@dataclass(frozen=True)
class Model:
    """A small decoder of one family; ``kind`` is the HF model_type."""

    kind: str
    seed: int
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 96
    rope_theta: float = 10000.0
    eps: float = 1e-6
    tied: bool = False
    context: int = 256
    #: rope_scaling as config.json holds it (None: none)
    rope_scaling: Mapping[str, Any] | None = None
    #: Phi-3's original_max_position_embeddings
    original_context: int | None = None
    sliding_window: int | None = None
    #: Gemma: query_pre_attn_scalar, soft caps, the local layers' rotary base
    query_pre_attn_scalar: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    local_rope_theta: float = 10000.0
    extra_config: Mapping[str, Any] = field(default_factory=dict)

    @property
    def gemma(self) -> bool:
        return self.kind in ("gemma2", "gemma3_text")

    @property
    def qk_norm(self) -> bool:
        return self.kind in ("qwen3", "gemma3_text")

    def local_layers(self) -> list[int]:
        """The sliding-window layers, as transformers' configs lay them out."""
        if self.sliding_window is None:
            return []
        if self.kind == "gemma2":
            return [i for i in range(self.layers) if (i + 1) % 2]
        if self.kind == "gemma3_text":
            return [i for i in range(self.layers) if (i + 1) % 6]
        return list(range(self.layers))


# -- weights ---------------------------------------------------------------------------------


def random_weights(m: Model) -> Weights:
    """Seeded float32 weights under transformers' names (a Gemma norm holds ``w`` of its
    ``1 + w``; Phi-3's q|k|v and gate|up fused), scaled to keep activations near unit RMS."""
    rng = np.random.default_rng(m.seed)
    h, hd = m.hidden, m.head_dim

    def mat(n_out: int, n_in: int, gain: float = 1.0) -> F32:
        return (rng.standard_normal((n_out, n_in)) * (gain / math.sqrt(n_in))).astype(np.float32)

    def norm(n: int) -> F32:
        w = 0.2 * rng.standard_normal(n)
        return (w if m.gemma else 1.0 + w).astype(np.float32)

    w: Weights = {
        "model.embed_tokens.weight": (
            (0.3 / (math.sqrt(h) if m.gemma else 1.0)) * rng.standard_normal((ck.VOCAB, h))
        ).astype(np.float32)
    }
    for i in range(m.layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(h)
        q, k, v = mat(m.heads * hd, h, 1.5), mat(m.kv_heads * hd, h, 1.5), mat(m.kv_heads * hd, h)
        if m.kind == "phi3":
            w[p + "self_attn.qkv_proj.weight"] = np.concatenate([q, k, v])
        else:
            w[p + "self_attn.q_proj.weight"] = q
            w[p + "self_attn.k_proj.weight"] = k
            w[p + "self_attn.v_proj.weight"] = v
        if m.qk_norm:
            w[p + "self_attn.q_norm.weight"] = norm(hd)
            w[p + "self_attn.k_norm.weight"] = norm(hd)
        w[p + "self_attn.o_proj.weight"] = mat(h, m.heads * hd)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        if m.gemma:
            w[p + "pre_feedforward_layernorm.weight"] = norm(h)
            w[p + "post_feedforward_layernorm.weight"] = norm(h)
        gate, up = mat(m.intermediate, h), mat(m.intermediate, h)
        if m.kind == "phi3":
            w[p + "mlp.gate_up_proj.weight"] = np.concatenate([gate, up])
        else:
            w[p + "mlp.gate_proj.weight"] = gate
            w[p + "mlp.up_proj.weight"] = up
        w[p + "mlp.down_proj.weight"] = mat(h, m.intermediate)
    w["model.norm.weight"] = norm(h)
    if not m.tied:
        w["lm_head.weight"] = mat(ck.VOCAB, h, 2.0)
    return w


# -- Hugging Face folders --------------------------------------------------------------------

_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}


def hf_config(m: Model) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": [_CLASSES[m.kind]],
        "model_type": m.kind,
        "hidden_size": m.hidden,
        "num_hidden_layers": m.layers,
        "num_attention_heads": m.heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_dim,
        "intermediate_size": m.intermediate,
        "vocab_size": ck.VOCAB,
        "max_position_embeddings": m.context,
        "rope_theta": m.rope_theta,
        "rope_scaling": None if m.rope_scaling is None else dict(m.rope_scaling),
        "rms_norm_eps": m.eps,
        "hidden_act": "gelu_pytorch_tanh" if m.gemma else "silu",
        "tie_word_embeddings": m.tied,
        "bos_token_id": ck.BOS_ID,
        "eos_token_id": ck.EOS_ID,
        "torch_dtype": "float32",
        "attention_bias": False,
    }
    if m.sliding_window is not None:
        cfg["sliding_window"] = m.sliding_window
    if m.original_context is not None:
        cfg["original_max_position_embeddings"] = m.original_context
    if m.gemma:
        cfg["hidden_activation"] = "gelu_pytorch_tanh"
        cfg["query_pre_attn_scalar"] = m.query_pre_attn_scalar or m.head_dim
        cfg["attn_logit_softcapping"] = m.attn_softcap
        cfg["final_logit_softcapping"] = m.final_softcap
    if m.kind == "gemma3_text":
        cfg["rope_local_base_freq"] = m.local_rope_theta
        cfg["layer_types"] = [
            "sliding_attention" if i in m.local_layers() else "full_attention"
            for i in range(m.layers)
        ]
    if m.kind == "qwen3":
        cfg |= {"use_sliding_window": False, "max_window_layers": m.layers}
    return cfg | dict(m.extra_config)


def write_hf(folder: Path, m: Model, weights: Weights) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(dict(weights), str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf_config(m), indent=2))
    (folder / "tokenizer.json").write_text(ck.tokenizer_json())
    tok_cfg = {
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "add_bos_token": False,
        "chat_template": ck.CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    return folder


# -- GGUF ------------------------------------------------------------------------------------

GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
}
_BLOCK_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def gguf_tensor_name(m: Model, hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    if rest == "post_attention_layernorm.weight":  # Gemma's post-attention norm, else pre-MLP
        return f"blk.{layer}.{'post_attention_norm' if m.gemma else 'ffn_norm'}.weight"
    return f"blk.{layer}.{_BLOCK_NAMES[rest]}"


def llama3_rope_factors(m: Model) -> F32:
    """llama.cpp's ``rope_freqs`` for rope scaling ``llama3``: each frequency's divisor."""
    rs = m.rope_scaling or {}
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    base = m.rope_theta ** (-np.arange(0, m.head_dim, 2, dtype=np.float64) / m.head_dim)
    out = []
    for freq in base:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def quantized(weights: Weights, qtype: gguf.GGMLQuantizationType) -> Weights:
    """The weights as a GGUF file of ``qtype`` matrices holds them (vectors stay F32)."""
    return {
        k: v
        if v.ndim == 1
        else np.asarray(gguf.quants.dequantize(gguf.quants.quantize(v, qtype), qtype), np.float32)
        for k, v in weights.items()
    }


def mixed_blocks(
    m: Model,
    weights: Weights,
    types: Callable[[str], gguf.GGMLQuantizationType | None],
) -> tuple[dict[str, tuple[gguf.GGMLQuantizationType, Any]], Weights]:
    """Random blocks for the matrices ``types`` gives a block type (of about the spread of
    ``weights``' own), as a ``_K_M`` file mixes them per tensor; and the weights the file
    then holds (the blocks dequantized by the ``gguf`` package, the rest as they are)."""
    rng = np.random.default_rng(m.seed + 1000)
    blocks: dict[str, tuple[gguf.GGMLQuantizationType, Any]] = {}
    held = dict(weights)
    for name in sorted(weights):
        arr = weights[name]
        qtype = types(name) if arr.ndim == 2 else None
        if qtype is None:
            continue
        raw = scaled_blocks(qtype, arr.shape[0], arr.shape[1], rng, float(arr.std()))
        blocks[name] = (qtype, raw)
        held[name] = gguf_dequantized(raw, qtype).reshape(arr.shape)
    return blocks, held


def gguf_meta(m: Model, arch: str | None = None) -> dict[str, int | float | str]:
    """The ``{arch}.`` keys llama.cpp's converter writes for this model (under their full
    names), typed as it types them when written: int as uint32, float as float32."""
    arch = arch or GGUF_ARCH[m.kind]
    meta: dict[str, int | float | str] = {
        "context_length": m.context,
        "embedding_length": m.hidden,
        "block_count": m.layers,
        "feed_forward_length": m.intermediate,
        "attention.head_count": m.heads,
        "attention.head_count_kv": m.kv_heads,
        "attention.key_length": m.head_dim,
        "attention.value_length": m.head_dim,
        "rope.freq_base": m.rope_theta,
        "attention.layer_norm_rms_epsilon": m.eps,
        "rope.dimension_count": m.head_dim,
        "vocab_size": ck.VOCAB,
    }
    if m.sliding_window is not None:
        meta["attention.sliding_window"] = m.sliding_window
    if m.attn_softcap is not None:
        meta["attn_logit_softcapping"] = m.attn_softcap
    if m.final_softcap is not None:
        meta["final_logit_softcapping"] = m.final_softcap
    rs = dict(m.rope_scaling or {})
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        meta["rope.scaling.type"] = "linear"
        meta["rope.scaling.factor"] = float(rs["factor"])
    if kind == "longrope":
        assert m.original_context is not None
        scale = m.context / m.original_context
        meta["rope.scaling.attn_factor"] = math.sqrt(
            1 + math.log(scale) / math.log(m.original_context)
        )
        meta["rope.scaling.original_context_length"] = m.original_context
    return {f"{arch}.{key}": value for key, value in meta.items()}


def write_gguf(
    path: Path,
    m: Model,
    weights: Weights,
    gguf_arch: str | None = None,
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    blocks: Mapping[str, tuple[gguf.GGMLQuantizationType, Any]] | None = None,
) -> Path:
    """A GGUF file as llama.cpp's converter writes this model, matrices in ``qtype`` (F32, or
    blocks: :func:`quantized` gives the values they hold); ``gguf_arch``: another
    ``general.architecture`` to write it under; ``blocks``: raw blocks (type, bytes) written
    as they are for the matrices they name (:func:`mixed_blocks`)."""
    arch = gguf_arch or GGUF_ARCH[m.kind]
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_name(f"tiny-{m.kind}")
    file_type = "ALL_F32" if qtype == gguf.GGMLQuantizationType.F32 else f"MOSTLY_{qtype.name}"
    w.add_file_type(int(gguf.LlamaFileType[file_type]))
    for key, value in gguf_meta(m, arch).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_float32(key, value)
    rs = dict(m.rope_scaling or {})
    kind = rs.get("rope_type", rs.get("type"))
    extra_tensors: dict[str, F32] = {}
    if kind == "llama3":
        extra_tensors["rope_freqs.weight"] = llama3_rope_factors(m)
    if kind == "longrope":
        extra_tensors["rope_factors_long.weight"] = np.asarray(rs["long_factor"], np.float32)
        extra_tensors["rope_factors_short.weight"] = np.asarray(rs["short_factor"], np.float32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(ck.TOKENS)
    w.add_token_types([ck.CONTROL if t in ck.SPECIALS else ck.NORMAL for t in ck.TOKENS])
    w.add_token_merges([f"{a} {b}" for a, b in ck.MERGES])
    w.add_bos_token_id(ck.BOS_ID)
    w.add_eos_token_id(ck.EOS_ID)
    w.add_add_bos_token(False)
    w.add_chat_template(ck.CHAT_TEMPLATE)
    for name, tensor in extra_tensors.items():
        w.add_tensor(name, tensor)
    for hf_name in sorted(weights):
        arr = weights[hf_name]
        if m.gemma and hf_name.endswith("norm.weight"):
            arr = arr + np.float32(1.0)  # llama.cpp's converter stores Gemma's 1 + w
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            arr = ck.llama_permute(arr, m.heads if "q_proj" in hf_name else m.kv_heads)
        arr = np.ascontiguousarray(arr, np.float32)
        if blocks and hf_name in blocks:
            own, raw = blocks[hf_name]
            w.add_tensor(gguf_tensor_name(m, hf_name), raw, raw_dtype=own)
        elif arr.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(
                gguf_tensor_name(m, hf_name), gguf.quants.quantize(arr, qtype), raw_dtype=qtype
            )
        else:
            w.add_tensor(gguf_tensor_name(m, hf_name), arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# -- the reference forward pass -------------------------------------------------------------


def inv_frequencies(m: Model, local: bool, position: int = 0) -> tuple[F64, float]:
    """A layer's rotary inverse frequencies at ``position`` and the factor on cos and sin, as
    transformers computes them (``_compute_default/linear/llama3/longrope_parameters``)."""
    hd = m.head_dim
    exponents = np.arange(0, hd, 2, dtype=np.float64) / hd
    if local and m.kind == "gemma3_text":
        return 1.0 / m.local_rope_theta**exponents, 1.0
    inv = 1.0 / m.rope_theta**exponents
    rs = dict(m.rope_scaling or {})
    kind = rs.get("rope_type", rs.get("type"))
    if kind is None:
        return inv, 1.0
    if kind == "linear":
        return inv / rs["factor"], 1.0
    if kind == "llama3":
        factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        return np.where(medium, smoothed, scaled), 1.0
    if kind == "longrope":
        assert m.original_context is not None
        scale = m.context / m.original_context
        attention = math.sqrt(1 + math.log(scale) / math.log(m.original_context))
        # transformers' decode step at ``position`` (seq_len = position + 1) takes the long
        # factors once seq_len exceeds the original length, the short ones before
        long = position + 1 > m.original_context
        ext = rs["long_factor"] if long else rs["short_factor"]
        return inv / np.asarray(ext, np.float64), attention
    raise ValueError(kind)


def _rms(x: F64, w: F32, eps: float, gemma: bool) -> F64:
    scale = 1.0 + w.astype(np.float64) if gemma else w.astype(np.float64)
    return np.asarray(x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale)


def _rotary(m: Model, x: F64, local: bool) -> F64:
    """Rotate-half rotary over [positions, heads, head_dim] at positions 0..n-1, each at its
    own frequencies (:func:`inv_frequencies`)."""
    n, half = x.shape[0], x.shape[-1] // 2
    rows = [inv_frequencies(m, local, p) for p in range(n)]
    ang = np.stack([p * inv for p, (inv, _) in enumerate(rows)])
    factor = rows[0][1]
    emb = np.concatenate([ang, ang], axis=-1)[:, None, :]
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return np.asarray((x * np.cos(emb) + rotated * np.sin(emb)) * factor)


def _gelu_tanh(x: F64) -> F64:
    return np.asarray(0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))))


def forward(m: Model, w: Mapping[str, F32], ids: list[int], *, window: bool = True) -> F64:
    """Logits [len(ids), vocab] for ``ids`` at positions 0, 1, ... (``window=False``: every
    layer attends over every position, for the negative checks)."""
    n, hd, eps, gemma = len(ids), m.head_dim, m.eps, m.gemma
    group = m.heads // m.kv_heads

    def lin(x: F64, name: str) -> F64:
        return np.asarray(x @ w[name].astype(np.float64).T)

    x = w["model.embed_tokens.weight"].astype(np.float64)[np.asarray(ids)]
    if gemma:  # transformers: the normalizer in the embedding's dtype (float32 here)
        x = x * float(np.float32(math.sqrt(m.hidden)))
    q_pos, k_pos = np.arange(n)[:, None], np.arange(n)[None, :]
    scale = (m.query_pre_attn_scalar or hd) ** -0.5 if gemma else hd**-0.5
    local_layers = m.local_layers() if window else []
    for i in range(m.layers):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps, gemma)
        if m.kind == "phi3":
            qkv = lin(h, p + "self_attn.qkv_proj.weight")
            q_size, kv_size = m.heads * hd, m.kv_heads * hd
            q, k, v = np.split(qkv, [q_size, q_size + kv_size], axis=-1)
        else:
            q = lin(h, p + "self_attn.q_proj.weight")
            k = lin(h, p + "self_attn.k_proj.weight")
            v = lin(h, p + "self_attn.v_proj.weight")
        q = q.reshape(n, m.heads, hd)
        k = k.reshape(n, m.kv_heads, hd)
        v = v.reshape(n, m.kv_heads, hd)
        if m.qk_norm:
            q = _rms(q, w[p + "self_attn.q_norm.weight"], eps, gemma)
            k = _rms(k, w[p + "self_attn.k_norm.weight"], eps, gemma)
        local = i in local_layers
        q, k = _rotary(m, q, local), _rotary(m, k, local)
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) * scale
        if m.attn_softcap:
            scores = m.attn_softcap * np.tanh(scores / m.attn_softcap)
        visible = k_pos <= q_pos
        if local:
            assert m.sliding_window is not None
            visible &= q_pos - k_pos < m.sliding_window
        scores = np.where(visible[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        att = np.einsum("hqk,khd->qhd", probs, v).reshape(n, m.heads * hd)
        out = lin(att, p + "self_attn.o_proj.weight")
        if gemma:
            out = _rms(out, w[p + "post_attention_layernorm.weight"], eps, gemma)
            h = _rms(x + out, w[p + "pre_feedforward_layernorm.weight"], eps, gemma)
        else:
            h = _rms(x + out, w[p + "post_attention_layernorm.weight"], eps, gemma)
        x = x + out
        if m.kind == "phi3":
            gate, up = np.split(lin(h, p + "mlp.gate_up_proj.weight"), 2, axis=-1)
        else:
            gate, up = lin(h, p + "mlp.gate_proj.weight"), lin(h, p + "mlp.up_proj.weight")
        act = _gelu_tanh(gate) if gemma else gate / (1.0 + np.exp(-gate))
        out = lin(act * up, p + "mlp.down_proj.weight")
        if gemma:
            out = _rms(out, w[p + "post_feedforward_layernorm.weight"], eps, gemma)
        x = x + out
    h = _rms(x, w["model.norm.weight"], eps, gemma)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    logits = h @ head.astype(np.float64).T
    if m.final_softcap:
        logits = m.final_softcap * np.tanh(logits / m.final_softcap)
    return np.asarray(logits, np.float64)
