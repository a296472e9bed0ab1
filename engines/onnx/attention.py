"""A decoder layer's attention in the graph, in either variant (``gqa``, ``masked``), and the
RMSNorms beside it (q/k norms, post-norms).

The attention's inputs are the layer's normalized hidden states; its output is the
output projection's (post-normalized where the spec says so), ready for the residual
add. See :mod:`sessiontape.engines.onnx.decoder` for the graph's I/O convention.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from sessiontape.engines.model_spec import SLOT_BLOCK, ModelSpec, is_local
from sessiontape.engines.onnx.graph import MS, Graph
from sessiontape.engines.weights import QuantMatrix, Tensor, Weights, scale_out


def rope_names(spec: ModelSpec, i: int) -> tuple[str, str]:
    """Layer ``i``'s cos and sin tables."""
    if spec.local_rope_theta is not None and is_local(spec, i):
        return "rope_cos_local", "rope_sin_local"
    return "rope_cos", "rope_sin"


def slot_mask(g: Graph, group: int, window: int = 0) -> tuple[str, str]:
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


def attention(
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
    wqkv = [scale_out(wq, fold) if fold != 1.0 else wq, weights(p + "wk"), weights(p + "wv")]
    qkv = g.linear_parts(xn, p + "wqkv", wqkv, spec.accuracy_level, dtype=spec.np_float)
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
        q_w = np.asarray(vector(spec, weights(p + "q_norm")), np.float32) * np.float32(scale)
        q = _head_norm(g, spec, q, g.const(p + "q_norm", q_w.astype(spec.np_float)), "q")
        k_w = vector(spec, weights(p + "k_norm"))
        k = _head_norm(g, spec, k, g.const(p + "k_norm", k_w), "kv")
        parts = (q, k, v)
    if spec.attention == "gqa":
        att = _gqa(g, spec, i, parts)
    else:
        att = _masked(g, spec, i, parts, masks[1] if is_local(spec, i) else masks[0])
    out = g.linear(att, p + "wo", weights(p + "wo"), spec.accuracy_level, dtype=spec.np_float)
    if spec.post_norms:
        out = rms(g, spec, out, weights, p + "post_attn_norm")
    return out


def _head_norm(g: Graph, spec: ModelSpec, x: str, weight: str, kind: str) -> str:
    """RMSNorm of each head of ``x`` [b, s, heads * head_dim] (``kind`` q or kv)."""
    heads = g.op("Reshape", [x, "c_shape_rows"])  # [b, s * heads, head_dim]
    return str(g.op("Reshape", [_plain_norm(g, spec, heads, weight), f"c_shape_{kind}h"]))


def rms(g: Graph, spec: ModelSpec, x: str, weights: Weights, name: str) -> str:
    """RMSNorm of ``x`` over the hidden size with the weight ``name``."""
    return _plain_norm(g, spec, x, g.const(name, vector(spec, weights(name))))


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


def softcap(g: Graph, x: str, cap: str, out: str | None = None) -> str:
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
    cos, sin = rope_names(spec, i)
    extra: dict[str, Any] = {}
    if is_local(spec, i):
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


def _masked(g: Graph, spec: ModelSpec, i: int, qkv: str | tuple[str, str, str], mask: str) -> str:
    """Layer ``i``'s attention as separate operators: rotary, a scatter into the buffer at
    ``position_ids``, scores masked by position (``mask``: causal, or the window's),
    soft-capped when the spec says so, softmax, and the weighted sum of values."""
    nh, nkv = spec.heads, spec.kv_heads
    if isinstance(qkv, str):
        q, k, v = g.op("Split", [qkv, "c_split_qkv"], outputs=3, axis=-1)
    else:
        q, k, v = qkv
    cos, sin = rope_names(spec, i)
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
        scores = softcap(g, scores, "c_attn_softcap")
    probs = g.op("Softmax", [g.op("Where", [mask, scores, "c_neginf"])], axis=-1)
    # probs . V over blocks of SLOT_BLOCK slots, then a sum over the blocks: one GEMM over all
    # slots gets a handful of thread blocks (M = N = 64); this split has one per block
    pb = g.op("Transpose", [g.op("Reshape", [probs, "c_prob_blocks"])], perm=[0, 1, 3, 2, 4])
    part = g.op("MatMul", [pb, g.op("Reshape", [pv, "c_v_blocks"])])
    att = g.op("Reshape", [g.op("ReduceSum", [part, "c_axis2"], keepdims=0), "c_att"])
    return str(g.op("Reshape", [g.op("Transpose", [att], perm=[0, 2, 1, 3]), "c_shape_h"]))


def vector(spec: ModelSpec, w: Tensor) -> npt.NDArray[Any]:
    if isinstance(w, QuantMatrix):
        raise ValueError("a norm weight must be a float vector, not a quantized matrix")
    return np.asarray(w).astype(spec.np_float, copy=False)
