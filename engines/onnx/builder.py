"""The decoder graph builder: a Llama-style model in the engine's I/O convention, from any weights.

Two callers: the demo model (:mod:`sessiontape.engines.onnx.demo`, random
weights from a fixed seed) and the importer (:mod:`sessiontape.engines.models`,
the weights of a GGUF file or a Hugging Face checkpoint). Both describe the
model as a :class:`ModelSpec` and hand over its weights by name
(:data:`Weights`); this module writes the ``static`` layout graph::

    input_ids [b, s] int64, attention_mask [b, t] int64, position_ids [b, s] int64,
    past_key_values.N.key|value [b, kv_heads, capacity, head_dim] float32 (or float16)
    -> logits [b, s, vocab] float32, present.N.key|value (the same buffers, written at
       position_ids), hidden_states.N [b, s, hidden] float32 (N = 0 embeddings, N = i after
       layer i)

Weight names (matrices are ``[in, out]`` float32 arrays or :class:`QuantMatrix`)::

    embed [vocab, hidden] (float32, or an 8-bit QuantMatrix with n = vocab),
    l{i}.attn_norm, l{i}.wq, l{i}.wk, l{i}.wv, [l{i}.bq, l{i}.bk, l{i}.bv],
    [l{i}.q_norm, l{i}.k_norm], l{i}.wo, [l{i}.post_attn_norm], l{i}.mlp_norm,
    l{i}.wg, l{i}.wu, l{i}.wd, [l{i}.post_mlp_norm], final_norm, lm_head [hidden, vocab]

(bracketed names only where the spec has the feature: ``qkv_bias``, ``qk_norm``,
``post_norms``). Norm weights are the factors the normalized values are multiplied
by: a Gemma norm's ``1 + w`` is added by the source, not here.

Beside the Llama block, the spec switches on what Qwen3, Gemma 2/3, Phi-3 and
Mistral add (:class:`ModelSpec`): per-head RMSNorm of q and k before the
rotary (``qk_norm``), norms after the attention and the MLP (``post_norms``),
the embedding scaled by a constant (``embed_scale``), a GELU-tanh gated MLP
(``activation``), a query scale other than ``head_dim ** -0.5``
(``query_scale``), soft-capped attention scores and logits (``cap * tanh(x /
cap)``), sliding-window layers (``sliding_window``, ``local_layers``: a query at
position p sees keys at p - window < j <= p) with their own rotary base
(``local_rope_theta``), and a factor on the rotary tables (``rope_attention_factor``,
Phi-3's long-rope scaling). The key/value buffers hold every position on every
layer, so a window is a mask over positions and stays exact however long the
sequence grows.

A quantized matrix runs as com.microsoft ``MatMulNBits`` (4 or 8 bits, blocks
along the input dimension, computed with int8 activations at
``accuracy_level`` 4 on the CPU), so a token reads the quantized bytes, not
float32 copies. Blocks whose values are ``scale * q + offset`` (GGUF's Q4_1)
keep the offset as a small float matrix: ``x . w = MatMulNBits(x) +
blocksum(x) . offsets``, which stays on MatMulNBits' fast path (a float zero
point would leave it). An 8-bit embedding is read with
``GatherBlockQuantized``.

With ``ModelSpec.float_type`` ``float16`` the graph computes in float16:
float weights are rounded to float16 as they are written (a QuantMatrix is
dequantized first), activations and the KV buffers are float16 (ONNX
Runtime's CPU provider runs every operator here in float16, both attentions
included; float16 is meant for CUDA), and ``logits`` and ``hidden_states.N``
are cast to float32 at the outputs, so what reads them (sampling, logprobs,
readouts) is the same for either type.

The builder streams: it asks for each weight when it writes it, and with
``data_file`` set writes every large initializer straight to that file
(ONNX external data, 4 KiB aligned so ONNX Runtime can map it), so peak
memory is about one layer's weights, whatever the model's size.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from sessiontape.engines.onnx.graph import MS, Graph
from sessiontape.engines.onnx.weights import (
    F32,
    U8,
    QuantMatrix,
    Tensor,
    Weights,
    concat_out,
    scale_out,
)

__all__ = [
    "F32",
    "SLOT_BLOCK",
    "U8",
    "Graph",
    "ModelSpec",
    "QuantMatrix",
    "RopeScaling",
    "Tensor",
    "Weights",
    "build_static",
    "write_model",
]

#: the static layout's buffer capacity is a multiple of this (slot indices are built in blocks)
SLOT_BLOCK = 64
#: the graph's float types (ModelSpec.float_type) and their numpy types
FLOAT_TYPES: dict[str, Any] = {"float32": np.float32, "float16": np.float16}


@dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling: ``linear`` (positions / factor) or ``llama3`` (Llama 3.1's bands)."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a Llama-family decoder (Llama 2/3, SmolLM, TinyLlama, Mistral, Qwen2)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_length: int
    head_dim: int
    rope_theta: float = 10000.0
    eps: float = 1e-5
    rope_scaling: RopeScaling | None = None
    #: per-frequency divisors of the rotary frequencies (llama.cpp's ``rope_freqs`` tensor, as
    #: a GGUF stores Llama 3.1's scaling), applied after ``rope_scaling``
    rope_freq_factors: tuple[float, ...] | None = None
    #: q, k and v projections have biases (Qwen2)
    qkv_bias: bool = False
    #: q and k are RMS-normalized per head (weights ``l{i}.q_norm``, ``l{i}.k_norm`` of
    #: head_dim) before the rotary (Qwen3, Gemma 3)
    qk_norm: bool = False
    #: the attention's and the MLP's outputs are RMS-normalized before their residual adds
    #: (``l{i}.post_attn_norm``, ``l{i}.post_mlp_norm``; Gemma 2 and 3)
    post_norms: bool = False
    #: the embedding's rows are multiplied by this (Gemma: sqrt(hidden), rounded to the
    #: graph's float type as transformers rounds it to the embedding's)
    embed_scale: float | None = None
    #: the gated MLP's activation: ``silu`` or ``gelu_tanh`` (GELU, tanh approximation)
    activation: str = "silu"
    #: the attention scores' scale (None: head_dim ** -0.5; Gemma: query_pre_attn_scalar ** -0.5)
    query_scale: float | None = None
    #: attention scores become ``cap * tanh(scores / cap)`` before the softmax (Gemma 2)
    attn_softcap: float | None = None
    #: logits become ``cap * tanh(logits / cap)`` (Gemma 2)
    final_softcap: float | None = None
    #: keys visible to the query at position p on a local layer: p - window < j <= p (0: none)
    sliding_window: int = 0
    #: the layers that attend over the window (the others attend over every position)
    local_layers: tuple[int, ...] = ()
    #: the rotary base of the local layers, which take no rope scaling (Gemma 3); None:
    #: the same rotary as the global layers
    local_rope_theta: float | None = None
    #: cos and sin multiplied by this (Phi-3's long-rope attention factor)
    rope_attention_factor: float = 1.0
    #: MatMulNBits' accuracy_level (4: int8 activations, the CPU's fast path)
    accuracy_level: int = 4
    #: attention as separate operators over a mask by position (``masked``), or one fused
    #: com.microsoft GroupQueryAttention per layer (``gqa``; see :func:`_gqa`)
    attention: str = "masked"
    #: the element type the graph computes in, ``float32`` or ``float16`` (float weights,
    #: activations and the KV buffers; ``logits`` and ``hidden_states.N`` stay float32)
    float_type: str = "float32"

    @property
    def np_float(self) -> Any:
        """The numpy type of :attr:`float_type`."""
        if self.float_type not in FLOAT_TYPES:
            raise ValueError(f"float_type must be one of {', '.join(FLOAT_TYPES)}")
        return FLOAT_TYPES[self.float_type]


def rope_rows(max_length: int) -> int:
    """Positions the rotary tables cover: max_length + 1, rounded up to a multiple of SLOT_BLOCK."""
    return -(-(max_length + 1) // SLOT_BLOCK) * SLOT_BLOCK


def inv_frequencies(spec: ModelSpec, local: bool = False) -> npt.NDArray[np.float64]:
    """The rotary inverse frequencies, with the spec's scaling applied (``local``: the
    sliding-window layers' own base, unscaled, when the spec has one)."""
    hd = spec.head_dim
    if local and spec.local_rope_theta is not None:
        return 1.0 / (spec.local_rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    inv = 1.0 / (spec.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    if spec.rope_freq_factors is not None:
        factors = np.asarray(spec.rope_freq_factors, dtype=np.float64)
        if factors.shape != inv.shape or not np.all(factors > 0):
            raise ValueError(f"rope frequency factors must be {inv.shape[0]} positive numbers")
        return _scaled(spec, inv) / factors
    return _scaled(spec, inv)


def _scaled(spec: ModelSpec, inv: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    sc = spec.rope_scaling
    if sc is None:
        return inv
    if sc.kind == "linear":
        return inv / sc.factor
    if sc.kind == "llama3":
        low_wl = sc.original_max_position / sc.low_freq_factor
        high_wl = sc.original_max_position / sc.high_freq_factor
        wl = 2 * math.pi / inv
        smooth = (sc.original_max_position / wl - sc.low_freq_factor) / (
            sc.high_freq_factor - sc.low_freq_factor
        )
        mid = (1 - smooth) * inv / sc.factor + smooth * inv
        return np.where(wl > low_wl, inv / sc.factor, np.where(wl < high_wl, inv, mid))
    raise ValueError(f"unsupported rope scaling {sc.kind!r}")


def rope_tables(spec: ModelSpec, local: bool = False) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
    """cos and sin [rope_rows, head_dim / 2], in the graph's float type (rounded once, from
    float64); ``local``: the sliding-window layers' tables (:func:`inv_frequencies`)."""
    rows = np.arange(rope_rows(spec.max_length), dtype=np.float64)
    ang = np.outer(rows, inv_frequencies(spec, local))
    factor = 1.0 if local and spec.local_rope_theta is not None else spec.rope_attention_factor
    cos, sin = np.cos(ang) * factor, np.sin(ang) * factor
    return cos.astype(spec.np_float), sin.astype(spec.np_float)


def _rope_names(spec: ModelSpec, i: int) -> tuple[str, str]:
    """Layer ``i``'s cos and sin tables."""
    if spec.local_rope_theta is not None and _is_local(spec, i):
        return "rope_cos_local", "rope_sin_local"
    return "rope_cos", "rope_sin"


def _is_local(spec: ModelSpec, i: int) -> bool:
    return spec.sliding_window > 0 and i in spec.local_layers


def _slot_mask(g: Graph, group: int, window: int = 0) -> tuple[str, str]:
    """[b, 1, group * s, t]: key slot j visible to the query at position q iff j <= q; and
    with ``window`` the local layers' mask, iff q - window < j <= q (else the first again).

    Slot j of the buffer holds position j. attention_mask is accepted for the
    convention but not read (a one-sequence pass has no left padding, and
    onnxruntime-genai passes it shorter than the buffer). Slot indices come
    from the buffer's own length without shape arithmetic, as cumulative sums
    over blocks of SLOT_BLOCK (ONNX Runtime's CUDA CumSum costs O(n) per
    element); the positions are tiled before the compare (CUDA has no Tile
    for bool).
    """
    from onnx import TensorProto

    first = g.op("Gather", ["past_key_values.0.key", "c_zero_s"], axis=0)
    col = g.op("Gather", [g.op("Gather", [first, "c_zero_s"], axis=0), "c_zero_s"], axis=1)
    ones = g.op(
        "Add", [g.op("Mul", [g.op("Cast", [col], to=TensorProto.INT64), "c_zero"]), "c_one"]
    )
    blocks = g.op("Reshape", [ones, g.i64("c_blocks", -1, SLOT_BLOCK)])
    within = g.op("CumSum", [blocks, "c_axis1"])
    firsts = g.op("CumSum", [g.op("Gather", [blocks, "c_zero_s"], axis=1), "c_zero_s"])
    base = g.op("Mul", [g.op("Sub", [firsts, "c_one"]), "c_block"])
    slots = g.op(
        "Reshape",
        [
            g.op("Sub", [g.op("Add", [within, g.op("Unsqueeze", [base, "c_axis1"])]), "c_one"]),
            "c_axis_neg1",
        ],
    )
    rows_pos = g.op("Tile", ["position_ids", g.i64("c_tile_group", 1, group)])
    at = g.op("Unsqueeze", [rows_pos, "c_axis_neg1"])
    causal = g.op("LessOrEqual", [slots, at])
    mask = str(g.op("Unsqueeze", [causal, "c_axis1"]))
    if not window:
        return mask, mask
    near = g.op("Greater", [g.op("Add", [slots, g.i64("c_window", window)]), at])
    return mask, str(g.op("Unsqueeze", [g.op("And", [causal, near]), "c_axis1"]))


def _constants(g: Graph, spec: ModelSpec) -> None:
    h, nh, nkv, hd = spec.hidden, spec.heads, spec.kv_heads, spec.head_dim
    g.const("c_zero_s", np.array(0, np.int64))
    for name, val in (("c_axis0", 0), ("c_axis1", 1), ("c_axis_neg1", -1), ("c_axis2", 2)):
        g.i64(name, val)
    g.i64("c_one", 1)
    g.const("c_one_s", np.array(1, np.int64))
    g.i64("c_zero", 0)
    g.i64("c_block", SLOT_BLOCK)
    g.const("c_neginf", np.array(-np.inf, spec.np_float))
    g.const("c_zero_f", np.array(0.0, spec.np_float))
    g.i64("c_split_qkv", nh * hd, nkv * hd, nkv * hd)
    g.i64("c_split_gu", spec.intermediate, spec.intermediate)
    g.i64("c_shape_q", 0, 0, nh, hd)
    g.i64("c_shape_kv", 0, 0, nkv, hd)
    g.i64("c_shape_h", 0, 0, nh * hd)
    g.i64("c_shape_kvh", 0, -1, nkv * hd)
    g.i64("c_shape_qh", 0, -1, nh * hd)
    g.i64("c_shape_rows", 0, -1, hd)
    g.i64("c_gq", 0, nkv, -1, hd)
    g.i64("c_att", 0, nh, -1, hd)
    g.i64("c_prob_blocks", 0, 0, 0, -1, SLOT_BLOCK)
    g.i64("c_v_blocks", 0, 0, -1, SLOT_BLOCK, hd)
    assert h > 0
    cos, sin = rope_tables(spec)
    g.const("rope_cos", cos)
    g.const("rope_sin", sin)
    if spec.attn_softcap and spec.attention == "masked":
        g.const("c_attn_softcap", np.array(spec.attn_softcap, spec.np_float))
    if spec.local_rope_theta is not None and spec.sliding_window and spec.local_layers:
        cos, sin = rope_tables(spec, local=True)
        g.const("rope_cos_local", cos)
        g.const("rope_sin_local", sin)


def _embedding(g: Graph, spec: ModelSpec, w: Tensor) -> str:
    """The rows of ``input_ids`` (``hidden_states.0``), times ``embed_scale`` when set."""
    out = _inner(spec, "hidden_states.0")
    if spec.embed_scale is None:
        return _gather(g, spec, w, out)
    rows = _gather(g, spec, w, None)
    scale = g.const("embed_scale", np.array(spec.embed_scale, spec.np_float))
    return str(g.op("Mul", [rows, scale], name=out))


def _gather(g: Graph, spec: ModelSpec, w: Tensor, out: str | None) -> str:
    if isinstance(w, QuantMatrix):
        if w.bits != 8 or w.offsets is not None or spec.float_type != "float32":
            w = w.dequantize()
        else:
            return str(
                g.op(
                    "GatherBlockQuantized",
                    [
                        g.const("embed.q", w.data.reshape(w.n, w.k)),
                        "input_ids",
                        g.const("embed.scales", w.scales),
                    ],
                    domain=MS,
                    bits=8,
                    block_size=w.block,
                    gather_axis=0,
                    quantize_axis=1,
                    name=out,
                )
            )
    table = g.const("embed", w.astype(spec.np_float, copy=False))
    return str(g.op("Gather", [table, "input_ids"], axis=0, name=out))


def _inner(spec: ModelSpec, name: str) -> str:
    """The name a float32 output ``name`` has inside the graph: itself, or in a float16 graph
    a value that :func:`_to_outputs` casts to it."""
    return name if spec.float_type == "float32" else name + ".inner"


def _to_outputs(g: Graph, spec: ModelSpec) -> None:
    """A float16 graph's logits and hidden states, cast to float32 (the outputs' type)."""
    from onnx import TensorProto

    if spec.float_type == "float32":
        return
    for name in ["logits", *(f"hidden_states.{i}" for i in range(spec.layers + 1))]:
        g.op("Cast", [_inner(spec, name)], to=TensorProto.FLOAT, name=name)


def _attention(
    g: Graph, spec: ModelSpec, i: int, xn: str, weights: Weights, masks: tuple[str, str]
) -> str:
    """Layer ``i``'s attention output (before its output projection's residual add).

    The attention scale is folded into q's weights and bias, or with q/k norms (which
    would undo it) into q's norm weights."""
    hd = spec.head_dim
    p = f"l{i}."
    scale = spec.query_scale if spec.query_scale is not None else hd**-0.5
    fold = 1.0 if spec.qk_norm else scale
    wq = weights(p + "wq")
    wqkv = concat_out([scale_out(wq, fold) if fold != 1.0 else wq, weights(p + "wk"), weights(p + "wv")])
    qkv = g.linear(xn, p + "wqkv", wqkv, spec.accuracy_level, dtype=spec.np_float)
    if spec.qkv_bias:
        bias = np.concatenate(
            [
                np.asarray(weights(p + "bq"), np.float32) * np.float32(fold),
                np.asarray(weights(p + "bk"), np.float32),
                np.asarray(weights(p + "bv"), np.float32),
            ]
        ).astype(spec.np_float)
        qkv = g.op("Add", [qkv, g.const(p + "bqkv", bias)])
    parts: str | tuple[str, str, str] = qkv
    if spec.qk_norm:
        q, k, v = g.op("Split", [qkv, "c_split_qkv"], outputs=3, axis=-1)
        q_w = np.asarray(_vector(spec, weights(p + "q_norm")), np.float32) * np.float32(scale)
        q = _head_norm(g, spec, q, g.const(p + "q_norm", q_w.astype(spec.np_float)), "q")
        k_w = _vector(spec, weights(p + "k_norm"))
        k = _head_norm(g, spec, k, g.const(p + "k_norm", k_w), "kv")
        parts = (q, k, v)
    if spec.attention == "gqa":
        att = _gqa(g, spec, i, parts)
    else:
        att = _masked(g, spec, i, parts, masks[1] if _is_local(spec, i) else masks[0])
    out = g.linear(att, p + "wo", weights(p + "wo"), spec.accuracy_level, dtype=spec.np_float)
    if spec.post_norms:
        out = _rms(g, spec, out, weights, p + "post_attn_norm")
    return out


def _head_norm(g: Graph, spec: ModelSpec, x: str, weight: str, kind: str) -> str:
    """RMSNorm of each head of ``x`` [b, s, heads * head_dim] (``kind`` q or kv)."""
    heads = g.op("Reshape", [x, "c_shape_rows"])  # [b, s * heads, head_dim]
    return str(g.op("Reshape", [_plain_norm(g, spec, heads, weight), f"c_shape_{kind}h"]))


def _rms(g: Graph, spec: ModelSpec, x: str, weights: Weights, name: str) -> str:
    """RMSNorm of ``x`` over the hidden size with the weight ``name``."""
    return _plain_norm(g, spec, x, g.const(name, _vector(spec, weights(name))))


def _plain_norm(g: Graph, spec: ModelSpec, x: str, weight: str) -> str:
    """RMSNorm over the last axis of a 3-d ``x``: the fused skip-norm over a zero skip (ONNX
    opset 18 has no RMSNorm of its own)."""
    xn, _, _, _ = g.op(
        "SkipSimplifiedLayerNormalization",
        [x, g.op("Mul", [x, "c_zero_f"]), weight],
        outputs=4,
        domain=MS,
        epsilon=spec.eps,
    )
    return str(xn)


def _softcap(g: Graph, x: str, cap: str, out: str | None = None) -> str:
    """``cap * tanh(x / cap)`` (``cap``: the name of a scalar constant)."""
    return str(g.op("Mul", [g.op("Tanh", [g.op("Div", [x, cap])]), cap], name=out))


def _gqa(g: Graph, spec: ModelSpec, i: int, qkv: str | tuple[str, str, str]) -> str:
    """Layer ``i``'s attention as one com.microsoft GroupQueryAttention over packed q, k, v
    (or q, k and v apart, after q/k norms).

    It applies the rotary embedding (rotate-half, from the same cos/sin
    tables), writes the pass's keys and values into the layer's buffer
    (present bound to past: in place, nothing copied) and attends causally.
    It places a pass's rows at the last positions of the sequence:
    ``seqlens_k`` is the batch row's last position (``c_seqlens_k``), so the
    rows of a pass must be consecutive positions, which the runners keep
    (their padding rows follow the real ones; a fixed-shape runner's context
    is capped so they never clamp). The attention scale is folded into q.
    A local layer's window is the operator's ``local_window_size``, which
    counts the keys before the query's own (window - 1); soft-capping is its
    ``softcap``, applied to the scaled scores.
    """
    q, k, v = (qkv, "", "") if isinstance(qkv, str) else qkv
    cos, sin = _rope_names(spec, i)
    extra: dict[str, Any] = {}
    if _is_local(spec, i):
        extra["local_window_size"] = spec.sliding_window
    if spec.attn_softcap:
        extra["softcap"] = float(spec.attn_softcap)
    att, _, _ = g.op(
        "GroupQueryAttention",
        [
            q,
            k,
            v,
            f"past_key_values.{i}.key",
            f"past_key_values.{i}.value",
            "c_seqlens_k",
            "c_total_len",
            cos,
            sin,
        ],
        outputs=3,
        domain=MS,
        num_heads=spec.heads,
        kv_num_heads=spec.kv_heads,
        do_rotary=1,
        rotary_interleaved=0,
        scale=1.0,
        **extra,
    )
    g.nodes[-1].output[1] = f"present.{i}.key"
    g.nodes[-1].output[2] = f"present.{i}.value"
    return str(att)


def _masked(
    g: Graph, spec: ModelSpec, i: int, qkv: str | tuple[str, str, str], mask: str
) -> str:
    """Layer ``i``'s attention as separate operators: rotary, a scatter into the buffer at
    ``position_ids``, scores masked by position (``mask``: causal, or the window's),
    soft-capped when the spec says so, softmax, and the weighted sum of values."""
    nh, nkv = spec.heads, spec.kv_heads
    if isinstance(qkv, str):
        q, k, v = g.op("Split", [qkv, "c_split_qkv"], outputs=3, axis=-1)
    else:
        q, k, v = qkv
    cos, sin = _rope_names(spec, i)
    q = g.op("RotaryEmbedding", [q, "position_ids", cos, sin], domain=MS, num_heads=nh)
    k = g.op("RotaryEmbedding", [k, "position_ids", cos, sin], domain=MS, num_heads=nkv)

    def heads(x: str, shape: str) -> str:
        return str(g.op("Transpose", [g.op("Reshape", [x, shape])], perm=[0, 2, 1, 3]))

    scatter_at = "c_scatter_at"
    # written at their positions into the buffer (in place when present is bound to past)
    pk = g.op(
        "ScatterElements",
        [f"past_key_values.{i}.key", scatter_at, heads(k, "c_shape_kv")],
        axis=2,
        name=f"present.{i}.key",
    )
    pv = g.op(
        "ScatterElements",
        [f"past_key_values.{i}.value", scatter_at, heads(v, "c_shape_kv")],
        axis=2,
        name=f"present.{i}.value",
    )
    qg = g.op("Reshape", [heads(q, "c_shape_q"), "c_gq"])
    scores = g.op("MatMul", [qg, g.op("Transpose", [pk], perm=[0, 1, 3, 2])])
    if spec.attn_softcap:
        scores = _softcap(g, scores, "c_attn_softcap")
    probs = g.op("Softmax", [g.op("Where", [mask, scores, "c_neginf"])], axis=-1)
    # probs . V over blocks of SLOT_BLOCK slots, then a sum over the blocks: one GEMM over all
    # slots gets a handful of thread blocks (M = N = 64); this split has one per block
    pb = g.op("Transpose", [g.op("Reshape", [probs, "c_prob_blocks"])], perm=[0, 1, 3, 2, 4])
    part = g.op("MatMul", [pb, g.op("Reshape", [pv, "c_v_blocks"])])
    att = g.op("Reshape", [g.op("ReduceSum", [part, "c_axis2"], keepdims=0), "c_att"])
    return str(g.op("Reshape", [g.op("Transpose", [att], perm=[0, 2, 1, 3]), "c_shape_h"]))


def _mlp(g: Graph, spec: ModelSpec, i: int, xn: str, weights: Weights) -> str:
    p = f"l{i}."
    dt = spec.np_float
    wg, wu = weights(p + "wg"), weights(p + "wu")
    if isinstance(wg, QuantMatrix) and isinstance(wu, QuantMatrix) and spec.float_type == "float32":
        # blocks: one MatMulNBits (and one offsets term) instead of two, then a Split
        gate_up = g.linear(xn, p + "wgu", concat_out([wg, wu]), spec.accuracy_level)
        gate, up = g.op("Split", [gate_up, "c_split_gu"], outputs=2, axis=-1)
    else:
        # float: two MatMuls (one over both, then a Split, ran 8% slower on the demo)
        gate = g.linear(xn, p + "wg", wg, spec.accuracy_level, dtype=dt)
        up = g.linear(xn, p + "wu", wu, spec.accuracy_level, dtype=dt)
    if spec.activation == "gelu_tanh":
        act = g.op("Mul", [g.op("FastGelu", [gate], domain=MS), up])
    else:
        act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])
    out = g.linear(act, p + "wd", weights(p + "wd"), spec.accuracy_level, dtype=dt)
    if spec.post_norms:
        out = _rms(g, spec, out, weights, p + "post_mlp_norm")
    return out


def _vector(spec: ModelSpec, w: Tensor) -> npt.NDArray[Any]:
    if isinstance(w, QuantMatrix):
        raise ValueError("a norm weight must be a float vector, not a quantized matrix")
    return np.asarray(w).astype(spec.np_float, copy=False)


def _norm(g: Graph, x: str, delta: str, weight: str, eps: float, out: str) -> tuple[str, str]:
    """com.microsoft SkipSimplifiedLayerNormalization: (RMSNorm(x + delta), x + delta named ``out``)."""
    xn, _, _, _ = g.op(
        "SkipSimplifiedLayerNormalization",
        [x, delta, weight],
        outputs=4,
        domain=MS,
        epsilon=eps,
    )
    g.nodes[-1].output[3] = out
    return str(xn), out


def graph_io(
    spec: ModelSpec, past: str = "max_sequence_length", present: str = "max_sequence_length"
) -> tuple[list[Any], list[Any]]:
    """The convention's inputs and outputs: KV of ``past`` slots in, ``present`` out (one
    buffer in the static layout; the concat layout grows from past to total)."""
    from onnx import TensorProto, helper

    f32, i64t = TensorProto.FLOAT, TensorProto.INT64
    kv_type = TensorProto.FLOAT16 if spec.float_type == "float16" else f32
    kv_in: list[str | int] = ["batch", spec.kv_heads, past, spec.head_dim]
    kv_out: list[str | int] = ["batch", spec.kv_heads, present, spec.head_dim]
    inputs = [
        helper.make_tensor_value_info("input_ids", i64t, ["batch", "sequence_length"]),
        helper.make_tensor_value_info("attention_mask", i64t, ["batch", "total_sequence_length"]),
        helper.make_tensor_value_info("position_ids", i64t, ["batch", "sequence_length"]),
    ]
    outs = [helper.make_tensor_value_info("logits", f32, ["batch", "sequence_length", spec.vocab])]
    for i in range(spec.layers):
        for kind in ("key", "value"):
            inputs.append(
                helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", kv_type, kv_in)
            )
            outs.append(helper.make_tensor_value_info(f"present.{i}.{kind}", kv_type, kv_out))
    for i in range(spec.layers + 1):
        outs.append(
            helper.make_tensor_value_info(
                f"hidden_states.{i}", f32, ["batch", "sequence_length", spec.hidden]
            )
        )
    return inputs, outs


def build_static(spec: ModelSpec, weights: Weights, graph: Graph | None = None) -> Any:
    """The static-layout ModelProto for ``spec``, asking ``weights`` for each tensor in turn.

    Few kernels per pass (a pass is a CUDA graph of them): com.microsoft
    SkipSimplifiedLayerNormalization (the residual add and the RMSNorm of the
    next block in one kernel; its sum output is ``hidden_states.N``),
    com.microsoft RotaryEmbedding, one matrix for q, k and v (the attention
    scale folded into q's weights), one for gate and up, and no shape
    arithmetic, so every node stays on the device.
    """
    from onnx import helper

    g = graph or Graph()
    _check_features(spec)
    _constants(g, spec)
    masks = ("", "")
    if spec.attention == "masked":
        window = spec.sliding_window if spec.local_layers else 0
        masks = _slot_mask(g, spec.heads // spec.kv_heads, window)
        g.op(
            "Expand",
            [
                g.op("Reshape", ["position_ids", g.i64("c_pos4", 0, 1, -1, 1)]),
                g.i64("c_kv_expand", 1, spec.kv_heads, 1, spec.head_dim),
            ],
            name="c_scatter_at",
        )
    if spec.attention == "gqa":
        from onnx import TensorProto

        last = g.op("ReduceMax", ["position_ids", "c_axis1"], keepdims=0)
        g.op("Cast", [last], to=TensorProto.INT32, name="c_seqlens_k")
        total = g.op("Add", [g.op("ReduceMax", ["position_ids"], keepdims=0), "c_one_s"])
        g.op("Cast", [total], to=TensorProto.INT32, name="c_total_len")
    x = _embedding(g, spec, weights("embed"))
    eps = spec.eps
    xn, _ = _norm(
        g,
        x,
        g.op("Mul", [x, "c_zero_f"]),
        g.const("l0.attn_norm", _vector(spec, weights("l0.attn_norm"))),
        eps,
        "h_in",
    )
    for i in range(spec.layers):
        p = f"l{i}."
        att = _attention(g, spec, i, xn, weights, masks)
        mlp_norm = g.const(p + "mlp_norm", _vector(spec, weights(p + "mlp_norm")))
        xn, x = _norm(g, x, att, mlp_norm, eps, f"h{i}.mid")
        mlp = _mlp(g, spec, i, xn, weights)
        norm = "final_norm" if i + 1 == spec.layers else f"l{i + 1}.attn_norm"
        xn, x = _norm(
            g,
            x,
            mlp,
            g.const(norm, _vector(spec, weights(norm))),
            eps,
            _inner(spec, f"hidden_states.{i + 1}"),
        )
    # a float16 graph's head runs in float16 too: a float32 head (a cast of the final norm's
    # output, a float32 matrix) measured no closer to the float32 path on SmolLM2-135M
    logits = _inner(spec, "logits")
    if spec.final_softcap:
        raw = g.linear(xn, "lm_head", weights("lm_head"), spec.accuracy_level, None, spec.np_float)
        cap = g.const("c_final_softcap", np.array(spec.final_softcap, spec.np_float))
        _softcap(g, raw, cap, logits)
    else:
        g.linear(xn, "lm_head", weights("lm_head"), spec.accuracy_level, logits, spec.np_float)
    _to_outputs(g, spec)
    inputs, outs = graph_io(spec)
    graph_proto = helper.make_graph(g.nodes, f"sessiontape-{spec.name}", inputs, outs, g.inits)
    model = helper.make_model(
        graph_proto,
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(MS, 1)],
        producer_name="sessiontape",
    )
    model.ir_version = 8
    return model


#: the MLP activations the graph computes
ACTIVATIONS = ("silu", "gelu_tanh")


def _check_features(spec: ModelSpec) -> None:
    if spec.activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}")
    if spec.sliding_window < 0 or any(not 0 <= i < spec.layers for i in spec.local_layers):
        raise ValueError("a sliding window needs a positive size and layers of the model")
    for cap in (spec.attn_softcap, spec.final_softcap):
        if cap is not None and not cap > 0:
            raise ValueError(f"a soft cap must be positive, not {cap}")


def write_model(
    spec: ModelSpec, weights: Weights, out_dir: Path, data_name: str = "model.onnx.data"
) -> Path:
    """Build ``spec`` into ``out_dir/model.onnx`` with its initializers in ``data_name``.

    Writes to temporary names and renames, data first, so a reader never sees
    a model whose data is incomplete. Returns the model file's path.
    """
    import os

    import onnx

    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = f".tmp{os.getpid()}"
    data_path = out_dir / (data_name + tmp)
    with data_path.open("wb") as data:
        model = build_static(spec, weights, Graph(data, data_name))
    data_path.replace(out_dir / data_name)
    model_path = out_dir / ("model.onnx" + tmp)
    model_path.write_bytes(model.SerializeToString())
    onnx.checker.check_model(str(model_path))
    model_path.replace(out_dir / "model.onnx")
    return out_dir / "model.onnx"


def iter_layer_names(spec: ModelSpec) -> Iterator[str]:
    """Every weight name the builder asks for, in order (for sources that pre-check names)."""
    yield "embed"
    yield "l0.attn_norm"
    for i in range(spec.layers):
        p = f"l{i}."
        yield from (p + "wq", p + "wk", p + "wv")
        if spec.qkv_bias:
            yield from (p + "bq", p + "bk", p + "bv")
        if spec.qk_norm:
            yield from (p + "q_norm", p + "k_norm")
        yield p + "wo"
        if spec.post_norms:
            yield p + "post_attn_norm"
        yield from (p + "mlp_norm", p + "wg", p + "wu", p + "wd")
        if spec.post_norms:
            yield p + "post_mlp_norm"
        yield "final_norm" if i + 1 == spec.layers else f"l{i + 1}.attn_norm"
    yield "lm_head"
