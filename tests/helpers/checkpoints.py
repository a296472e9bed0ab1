"""Tiny random checkpoints written as a Hugging Face folder or a GGUF file, and a numpy
forward pass over their weights: the reference for tests/engines/models/test_architectures.py.

Nothing here imports the importer: the writers follow the formats (safetensors, GGUF as
llama.cpp's converter writes it) and the forward pass follows transformers' Llama, Mistral
and Qwen2 (RMSNorm, rotate-half rotary, grouped-query causal attention, SiLU-gated MLP), so
an importer bug cannot cancel out against the same bug here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt
from safetensors.numpy import save_file

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
Weights = dict[str, F32]

NORMAL, CONTROL = 1, 3  # llama.cpp token types


@dataclass(frozen=True)
class Arch:
    """A small decoder; ``name`` is the HF model_type (and the GGUF architecture if any)."""

    name: str
    seed: int
    rope_theta: float
    eps: float
    bias: bool = False  # q/k/v biases (Qwen2)
    tied: bool = False  # lm_head is the embedding
    context: int = 512  # max_position_embeddings / {arch}.context_length
    sliding_window: int | None = None
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


LLAMA = Arch("llama", seed=11, rope_theta=10000.0, eps=1e-5)
QWEN2 = Arch("qwen2", seed=12, rope_theta=1e6, eps=1e-6, bias=True, tied=True)
MISTRAL = Arch("mistral", seed=13, rope_theta=1e6, eps=1e-5, context=1024, sliding_window=256)


# -- tokenizer: byte-level BPE over GPT-2's byte alphabet ----------------------------------


def byte_alphabet() -> list[str]:
    """GPT-2's spelling of each byte (byte b is ``byte_alphabet()[b]``)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    spelled = {b: chr(b) for b in printable} | {b: chr(0x100 + i) for i, b in enumerate(others)}
    return [spelled[b] for b in range(256)]


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES: list[tuple[str, str]] = [("Ġ", c) for c in "abcdefghijklmnopqrstuvwxyz"] + [
    ("h", "e"), ("Ġt", "he"), ("i", "n"), ("e", "r"), ("a", "n"), ("o", "n"), ("r", "e"),
    ("Ġa", "n"), ("Ġan", "d"), ("Ġi", "s"), ("a", "t"), ("Ġc", "at"), ("Ġs", "at"),
    ("l", "l"), ("o", "r"),
]  # fmt: skip
TOKENS = [*byte_alphabet(), *(a + b for a, b in MERGES), *SPECIALS]
VOCAB = len(TOKENS)  # 300: ids 0..255 bytes, then the merges, then the specials
BOS_ID, EOS_ID = TOKENS.index("<|endoftext|>"), TOKENS.index("<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tokenizer_json() -> str:
    """The vocabulary as a Hugging Face ``tokenizer.json``."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    assert len(set(TOKENS)) == VOCAB
    tok = Tokenizer(BPE({t: i for i, t in enumerate(TOKENS)}, MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    assert tok.get_vocab_size() == VOCAB
    return str(tok.to_str())


# -- weights ---------------------------------------------------------------------------------


def random_weights(arch: Arch) -> Weights:
    """Seeded float32 weights under transformers' names, scaled so that activations stay
    near unit RMS and the logits spread over a few units (attention is not uniform)."""
    rng = np.random.default_rng(arch.seed)
    h, hd, inter = arch.hidden, arch.head_dim, arch.intermediate

    def mat(n_out: int, n_in: int, gain: float = 1.0) -> F32:
        return (rng.standard_normal((n_out, n_in)) * (gain / math.sqrt(n_in))).astype(np.float32)

    def norm(n: int) -> F32:
        return (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    def bias(n: int) -> F32:
        return (0.5 * rng.standard_normal(n)).astype(np.float32)

    w: Weights = {
        "model.embed_tokens.weight": (0.3 * rng.standard_normal((VOCAB, h))).astype(np.float32)
    }
    for i in range(arch.layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "self_attn.q_proj.weight"] = mat(arch.heads * hd, h, 1.5)
        w[p + "self_attn.k_proj.weight"] = mat(arch.kv_heads * hd, h, 1.5)
        w[p + "self_attn.v_proj.weight"] = mat(arch.kv_heads * hd, h)
        if arch.bias:
            w[p + "self_attn.q_proj.bias"] = bias(arch.heads * hd)
            w[p + "self_attn.k_proj.bias"] = bias(arch.kv_heads * hd)
            w[p + "self_attn.v_proj.bias"] = bias(arch.kv_heads * hd)
        w[p + "self_attn.o_proj.weight"] = mat(h, arch.heads * hd)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        w[p + "mlp.gate_proj.weight"] = mat(inter, h)
        w[p + "mlp.up_proj.weight"] = mat(inter, h)
        w[p + "mlp.down_proj.weight"] = mat(h, inter)
    w["model.norm.weight"] = norm(h)
    if not arch.tied:
        w["lm_head.weight"] = mat(VOCAB, h, 2.0)
    return w


def bf16_round(w: Weights) -> Weights:
    """The weights as bfloat16 holds them (upper halves of float32, truncated)."""
    return {k: (v.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32) for k, v in w.items()}


def save_bf16(path: Path, weights: Weights) -> None:
    """A safetensors file of BF16 tensors, written by hand (safetensors.numpy has no bf16)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name in sorted(weights):
        blob = (weights[name].view(np.uint32) >> np.uint32(16)).astype("<u2").tobytes()
        header[name] = {
            "dtype": "BF16",
            "shape": list(weights[name].shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def hf_config(arch: Arch) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": [
            {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(
                arch.name, "MistralForCausalLM"
            )
        ],
        "model_type": arch.name,
        "hidden_size": arch.hidden,
        "num_hidden_layers": arch.layers,
        "num_attention_heads": arch.heads,
        "num_key_value_heads": arch.kv_heads,
        "intermediate_size": arch.intermediate,
        "vocab_size": VOCAB,
        "max_position_embeddings": arch.context,
        "rope_theta": arch.rope_theta,
        "rms_norm_eps": arch.eps,
        "hidden_act": "silu",
        "tie_word_embeddings": arch.tied,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "float32",
    }
    if arch.sliding_window is not None:
        cfg["sliding_window"] = arch.sliding_window
    if arch.name == "qwen2":  # as Qwen2's configs: a window that is switched off
        cfg |= {"sliding_window": 32, "use_sliding_window": False, "max_window_layers": 2}
    return cfg


def write_hf(
    folder: Path,
    arch: Arch,
    weights: Weights,
    *,
    bf16: bool = False,
    config: Mapping[str, Any] | None = None,
) -> Path:
    """A Hugging Face folder: config.json, model.safetensors, tokenizer.json and
    tokenizer_config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(config) if config is not None else hf_config(arch)
    if bf16:
        cfg["torch_dtype"] = "bfloat16"
        save_bf16(folder / "model.safetensors", weights)
    else:
        save_file(dict(weights), str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    (folder / "tokenizer.json").write_text(tokenizer_json())
    tok_cfg = {
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    return folder


# -- GGUF ------------------------------------------------------------------------------------


def llama_permute(w: F32, n_head: int) -> F32:
    """llama.cpp's converter's reordering of Q and K rows (convert_hf_to_gguf.py)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def llama_unpermute(w: F32, n_head: int) -> F32:
    """The inverse of :func:`llama_permute`, found by permuting the row indices."""
    moved = llama_permute(np.arange(w.shape[0], dtype=np.float32)[:, None], n_head)
    return w[np.argsort(moved[:, 0].astype(np.int64))]


_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[rest]}"


@dataclass(frozen=True)
class GgufFile:
    path: Path
    #: the weights the file holds, dequantized, un-permuted, under transformers' names
    weights: Weights
    #: the same, with Q and K left in llama.cpp's row order (for the negative check)
    stored: Weights


def write_gguf(
    path: Path,
    arch: Arch,
    weights: Weights,
    qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    *,
    gguf_arch: str | None = None,
    extra: Mapping[str, int | float | str] | None = None,
    extra_tensors: Mapping[str, F32] | None = None,
    general: Mapping[str, int | float | str] | None = None,
) -> GgufFile:
    """A GGUF file as llama.cpp's converter writes it; matrices in ``qtype`` (norms and biases
    stay F32). ``extra`` adds (or overrides) ``{arch}.``-relative integer/float/string keys;
    ``general`` adds whole keys (``general.sampling.temp``) typed the same way."""
    name = gguf_arch or arch.name
    w = gguf.GGUFWriter(str(path), arch=name)
    w.add_name(f"tiny-{arch.name}")
    file_type = {"F32": "ALL_F32", "F16": "MOSTLY_F16"}.get(qtype.name, f"MOSTLY_{qtype.name}")
    w.add_file_type(int(gguf.LlamaFileType[file_type]))
    meta: dict[str, int | float | str] = {
        "context_length": arch.context,
        "embedding_length": arch.hidden,
        "block_count": arch.layers,
        "feed_forward_length": arch.intermediate,
        "attention.head_count": arch.heads,
        "attention.head_count_kv": arch.kv_heads,
        "rope.freq_base": arch.rope_theta,
        "attention.layer_norm_rms_epsilon": arch.eps,
        "rope.dimension_count": arch.head_dim,
        "vocab_size": VOCAB,
        **(extra or {}),
    }
    keyed = {f"{name}.{key}": value for key, value in meta.items()} | dict(general or {})
    for key, value in keyed.items():  # as llama.cpp types them: uint32, float32, string
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_float32(key, value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_types([CONTROL if t in SPECIALS else NORMAL for t in TOKENS])
    w.add_token_merges([f"{a} {b}" for a, b in MERGES])
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    held: Weights = {}
    stored: Weights = {}
    permute = name == "llama"
    for hf_name in sorted(weights, key=_gguf_order):
        arr = weights[hf_name]
        n_head = {"q_proj": arch.heads, "k_proj": arch.kv_heads}.get(hf_name.split(".")[-2])
        if permute and n_head is not None and arr.ndim == 2:
            arr = llama_permute(arr, n_head)
        if arr.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name(hf_name), np.ascontiguousarray(arr))
        elif qtype == gguf.GGMLQuantizationType.F16:
            half = arr.astype(np.float16)
            w.add_tensor(gguf_name(hf_name), half)
            arr = half.astype(np.float32)
        else:
            raw = gguf.quants.quantize(arr, qtype)
            w.add_tensor(gguf_name(hf_name), raw, raw_dtype=qtype)
            arr = np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32)
        stored[hf_name] = arr
        held[hf_name] = (
            llama_unpermute(arr, n_head) if permute and n_head and arr.ndim == 2 else arr
        )
    for tname, tensor in (extra_tensors or {}).items():  # as written, e.g. rope_freqs.weight
        w.add_tensor(tname, np.ascontiguousarray(tensor, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GgufFile(path, held, stored)


def _gguf_order(hf_name: str) -> tuple[int, str]:
    """llama.cpp's order: token_embd, the blocks in order, output_norm, output."""
    if hf_name == "model.embed_tokens.weight":
        return (-1, "")
    if hf_name.startswith("model.layers."):
        return (int(hf_name.split(".")[2]), gguf_name(hf_name))
    return (1 << 20, hf_name)


# -- the reference forward pass -------------------------------------------------------------


def _rms_norm(x: F64, w: F32, eps: float) -> F64:
    rms = np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return np.asarray(x / rms * w.astype(np.float64), np.float64)


def _rotary(x: F64, theta: float) -> F64:
    """transformers' rotate-half rotary over [positions, heads, head_dim] at positions 0..n-1."""
    n, hd = x.shape[0], x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = np.outer(np.arange(n, dtype=np.float64), inv)
    emb = np.concatenate([ang, ang], axis=-1)[:, None, :]
    half = hd // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return np.asarray(x * np.cos(emb) + rotated * np.sin(emb), np.float64)


def forward(arch: Arch, w: Mapping[str, F32], ids: list[int]) -> F64:
    """Logits [len(ids), vocab] in float64 for the sequence ``ids`` at positions 0, 1, ..."""
    n, hd, eps = len(ids), arch.head_dim, arch.eps
    group = arch.heads // arch.kv_heads

    def lin(x: F64, name: str) -> F64:
        y = x @ w[name + ".weight"].astype(np.float64).T
        if name + ".bias" in w:
            y = y + w[name + ".bias"].astype(np.float64)
        return np.asarray(y, np.float64)

    x = w["model.embed_tokens.weight"].astype(np.float64)[np.asarray(ids)]
    causal = np.triu(np.ones((n, n), dtype=bool), k=1)
    for i in range(arch.layers):
        p = f"model.layers.{i}."
        h = _rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = _rotary(lin(h, p + "self_attn.q_proj").reshape(n, arch.heads, hd), arch.rope_theta)
        k = _rotary(lin(h, p + "self_attn.k_proj").reshape(n, arch.kv_heads, hd), arch.rope_theta)
        v = lin(h, p + "self_attn.v_proj").reshape(n, arch.kv_heads, hd)
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # query head j: kv j // g
        scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        scores[:, causal] = -np.inf
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        att = np.einsum("hqk,khd->qhd", probs, v).reshape(n, arch.heads * hd)
        x = x + lin(att, p + "self_attn.o_proj")
        h = _rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = lin(h, p + "mlp.gate_proj"), lin(h, p + "mlp.up_proj")
        x = x + lin(gate / (1.0 + np.exp(-gate)) * up, p + "mlp.down_proj")
    h = _rms_norm(x, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return np.asarray(h @ head.astype(np.float64).T, np.float64)


def run_imported(
    folder: Path, ids: list[int], chunks: list[int] | None = None, model: str = "model.onnx"
) -> F64:
    """The imported model's logits for ``ids``, run through onnxruntime in passes of
    ``chunks`` tokens (one pass by default), each pass's present buffers fed back as past."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3
    sess = ort.InferenceSession(str(folder / model), opts, providers=["CPUExecutionProvider"])
    pasts = [i for i in sess.get_inputs() if i.name.startswith("past_key_values.")]
    cap = -(-(len(ids) + 1) // 64) * 64
    kv_type = {"tensor(float)": np.float32, "tensor(float16)": np.float16}  # as the graph declares
    buffers = {
        p.name: np.zeros((1, int(p.shape[1]), cap, int(p.shape[3])), kv_type[p.type]) for p in pasts
    }
    presents = [p.name.replace("past_key_values.", "present.") for p in pasts]
    out, start = [], 0
    for size in chunks or [len(ids)]:
        feed: dict[str, Any] = {
            "input_ids": np.array([ids[start : start + size]], np.int64),
            "attention_mask": np.ones((1, cap), np.int64),
            "position_ids": np.arange(start, start + size, dtype=np.int64)[None],
            **buffers,
        }
        logits, *kv = sess.run(["logits", *presents], feed)
        buffers = {p.name: np.asarray(b) for p, b in zip(pasts, kv, strict=True)}
        out.append(np.asarray(logits, np.float64)[0])
        start += size
    assert start == len(ids)
    return np.concatenate(out)
