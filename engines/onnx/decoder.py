"""The decoder graph builder: a Llama-style model in the engine's I/O convention, from any weights.

Two callers: the demo model (:mod:`sessiontape.engines.onnx.demo`, random
weights from a fixed seed) and the importer (:mod:`sessiontape.engines.onnx.importer`,
the weights of a GGUF file or a Hugging Face checkpoint). Both describe the
model as a :class:`~sessiontape.engines.model_spec.ModelSpec` and hand over its
weights by name (:data:`~sessiontape.engines.weights.Weights`); this module writes the ``static`` layout graph::

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

The features of the families beyond Llama are :class:`ModelSpec`'s
(:mod:`sessiontape.engines.model_spec`); their attention is built by
:mod:`sessiontape.engines.onnx.attention`.

A quantized matrix runs as com.microsoft ``MatMulNBits`` (4 or 8 bits, blocks
along the input dimension, computed with int8 activations at
``accuracy_level`` 4 on the CPU), so a token reads the quantized bytes, not
float32 copies. Blocks whose values are ``scale * q + offset`` (GGUF's Q4_1)
keep the offset as a small float matrix: ``x . w = MatMulNBits(x) +
blocksum(x) . offsets``, which stays on MatMulNBits' fast path (a float zero
point would leave it). An embedding in blocks is read with
``GatherBlockQuantized`` (4 or 8 bits, its offsets added after), exactly.

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
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from sessiontape.engines.model_spec import SLOT_BLOCK, ModelSpec, check_features
from sessiontape.engines.onnx.attention import attention, rms, slot_mask, softcap, vector
from sessiontape.engines.onnx.graph import MS, Graph
from sessiontape.engines.weights import QuantMatrix, Tensor, Weights

#: an input (default 0) naming the first row the output head computes: ``logits`` holds
#: the rows from it on
LOGITS_FROM = "logits_from"

__all__ = [
    "LOGITS_FROM",
    "build_static",
    "gather_blocks",
    "graph_io",
    "inv_frequencies",
    "rope_rows",
    "rope_tables",
    "write_model",
]


def rope_rows(max_length: int) -> int:
    """Positions the rotary tables cover: max_length + 1, rounded up to a multiple of SLOT_BLOCK."""
    return -(-(max_length + 1) // SLOT_BLOCK) * SLOT_BLOCK


def inv_frequencies(
    spec: ModelSpec, local: bool = False, long: bool = False
) -> npt.NDArray[np.float64]:
    """The rotary inverse frequencies, with the spec's scaling applied (``local``: the
    sliding-window layers' own base, unscaled, when the spec has one; ``long``: with
    Phi-3's long factors in place of ``rope_freq_factors``)."""
    hd = spec.head_dim
    if local and spec.local_rope_theta is not None:
        return 1.0 / (spec.local_rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    inv = 1.0 / (spec.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    chosen = spec.rope_long_factors if long else spec.rope_freq_factors
    if chosen is not None:
        factors = np.asarray(chosen, dtype=np.float64)
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
    float64); ``local``: the sliding-window layers' tables (:func:`inv_frequencies`). With
    Phi-3's long factors, the rows from ``rope_long_from`` on are rotated by those: a
    position's rotation depends on the position alone, so it is the same however a
    history is split into passes."""
    rows = np.arange(rope_rows(spec.max_length), dtype=np.float64)
    ang = np.outer(rows, inv_frequencies(spec, local))
    own = local and spec.local_rope_theta is not None
    if spec.rope_long_factors is not None and not own:
        long = rows >= spec.rope_long_from
        ang[long] = np.outer(rows[long], inv_frequencies(spec, local, long=True))
    factor = 1.0 if own else spec.rope_attention_factor
    cos, sin = np.cos(ang) * factor, np.sin(ang) * factor
    return cos.astype(spec.np_float), sin.astype(spec.np_float)


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
        if w.bits != 8 or spec.float_type != "float32":
            w = w.dequantize()
        else:
            return gather_blocks(g, w, out)
    table = g.const("embed", w.astype(spec.np_float, copy=False))
    return str(g.op("Gather", [table, "input_ids"], axis=0, name=out))


def gather_blocks(g: Graph, w: QuantMatrix, out: str | None) -> str:
    """The rows of an 8-bit embedding (codes ``v + 128``), read as blocks, exactly.

    GatherBlockQuantized gives ``scale * (code - zero_point)`` per block. Codes that span
    at most 16 values around 128 (the 4- and fewer-bit formats: Q4_0, Q4_1, Q4_K, Q2_K,
    Q3_K) are held as 4 bits, ``code - low`` with the zero point ``128 - low``; the others
    as 8 bits with zero point 128. The offsets (Q4_1, Q4_K, Q2_K, Q5_1, Q5_K: a subtracted
    minimum) are gathered too and added per block: the float32 operations of
    :meth:`QuantMatrix.dequantize`, so the rows are the file's values bit for bit."""
    codes = w.data.reshape(w.n, w.k)
    blocks = w.k // w.block
    low, high = min(int(codes.min()), 128), int(codes.max())
    bits, zero = 8, 128
    if high - low <= 15 and low >= 128 - 15:
        bits, zero = 4, 128 - low
        codes = codes - np.uint8(low)
        codes = (codes[:, 0::2] | (codes[:, 1::2] << np.uint8(4))).astype(np.uint8)
        zero_points = np.full((w.n, (blocks + 1) // 2), zero | (zero << 4), np.uint8)
    else:
        zero_points = np.full((w.n, blocks), zero, np.uint8)
    rows = str(
        g.op(
            "GatherBlockQuantized",
            [
                g.const("embed.q", codes),
                "input_ids",
                g.const("embed.scales", w.scales),
                g.const("embed.zero_points", zero_points),
            ],
            domain=MS,
            bits=bits,
            block_size=w.block,
            gather_axis=0,
            quantize_axis=1,
            name=out if w.offsets is None else None,
        )
    )
    if w.offsets is None:
        return rows
    offsets = g.op("Gather", [g.const("embed.offsets", w.offsets), "input_ids"], axis=0)
    split = g.op("Reshape", [rows, g.i64("c_embed_blocks", 0, 0, blocks, w.block)])
    added = g.op("Add", [split, g.op("Unsqueeze", [offsets, "c_axis_neg1"])])
    return str(g.op("Reshape", [added, g.i64("c_embed_rows", 0, 0, w.k)], name=out))


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


def _mlp(g: Graph, spec: ModelSpec, i: int, xn: str, weights: Weights) -> str:
    p = f"l{i}."
    dt = spec.np_float
    wg, wu = weights(p + "wg"), weights(p + "wu")
    if isinstance(wg, QuantMatrix) and isinstance(wu, QuantMatrix) and spec.float_type == "float32":
        # blocks: one MatMulNBits (and one offsets term) instead of two, then a Split
        gate_up = g.linear_parts(xn, p + "wgu", [wg, wu], spec.accuracy_level)
        gate, up = g.op("Split", [gate_up, "c_split_gu"], outputs=2, axis=-1)
    else:
        # float: two MatMuls (one over both, then a Split, is slower for float weights)
        gate = g.linear(xn, p + "wg", wg, spec.accuracy_level, dtype=dt)
        up = g.linear(xn, p + "wu", wu, spec.accuracy_level, dtype=dt)
    if spec.activation == "gelu_tanh":
        act = g.op("Mul", [g.op("FastGelu", [gate], domain=MS), up])
    else:
        act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])
    out = g.linear(act, p + "wd", weights(p + "wd"), spec.accuracy_level, dtype=dt)
    if spec.post_norms:
        out = rms(g, spec, out, weights, p + "post_mlp_norm")
    return out


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


def _head(g: Graph, spec: ModelSpec, xn: str, weights: Weights) -> None:
    """``logits``: the output head, with final soft-capping where the model has it."""
    # a float16 graph's head runs in float16 too: a float32 head (a cast of the final norm's
    # output, a float32 matrix) comes no closer to the float32 path on SmolLM2-135M
    logits = _inner(spec, "logits")
    # the head runs on the rows from ``logits_from`` on (an input with a default of 0, so a
    # runner that does not feed it gets every row): a prefill chunk needs only its last rows'
    # logits, and the head is the largest matrix of a small model (Gemma 3 270M: 62% of the
    # weights), so a prompt's other rows skip it
    xn = g.op("Slice", [xn, LOGITS_FROM, g.i64("c_rows_end", 2**62), "c_axis1"])
    if spec.final_softcap:
        raw = g.linear(xn, "lm_head", weights("lm_head"), spec.accuracy_level, None, spec.np_float)
        cap = g.const("c_final_softcap", np.array(spec.final_softcap, spec.np_float))
        softcap(g, raw, cap, logits)
    else:
        g.linear(xn, "lm_head", weights("lm_head"), spec.accuracy_level, logits, spec.np_float)


def build_static(spec: ModelSpec, weights: Weights, graph: Graph | None = None) -> Any:
    """The static-layout ModelProto for ``spec``, asking ``weights`` for each tensor in turn.

    Few kernels per pass (a pass is a CUDA graph of them): com.microsoft
    SkipSimplifiedLayerNormalization (the residual add and the RMSNorm of the
    next block in one kernel; its sum output is ``hidden_states.N``),
    com.microsoft RotaryEmbedding, one matrix for q, k and v (the attention
    scale folded into q's weights), one for gate and up, and no shape
    arithmetic, so every node stays on the device.
    """
    from onnx import TensorProto, helper

    g = graph or Graph()
    check_features(spec)
    _constants(g, spec)
    masks = ("", "")
    if spec.attention == "masked":
        window = spec.sliding_window if spec.local_layers else 0
        masks = slot_mask(g, spec.heads // spec.kv_heads, window)
        g.op(
            "Expand",
            [
                g.op("Reshape", ["position_ids", g.i64("c_pos4", 0, 1, -1, 1)]),
                g.i64("c_kv_expand", 1, spec.kv_heads, 1, spec.head_dim),
            ],
            name="c_scatter_at",
        )
    if spec.attention == "gqa":
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
        g.const("l0.attn_norm", vector(spec, weights("l0.attn_norm"))),
        eps,
        "h_in",
    )
    for i in range(spec.layers):
        p = f"l{i}."
        att = attention(g, spec, i, xn, weights, masks)
        mlp_norm = g.const(p + "mlp_norm", vector(spec, weights(p + "mlp_norm")))
        xn, x = _norm(g, x, att, mlp_norm, eps, f"h{i}.mid")
        mlp = _mlp(g, spec, i, xn, weights)
        norm = "final_norm" if i + 1 == spec.layers else f"l{i + 1}.attn_norm"
        xn, x = _norm(
            g,
            x,
            mlp,
            g.const(norm, vector(spec, weights(norm))),
            eps,
            _inner(spec, f"hidden_states.{i + 1}"),
        )
    _head(g, spec, xn, weights)
    _to_outputs(g, spec)
    inputs, outs = graph_io(spec)
    g.i64(LOGITS_FROM, 0)
    inputs.append(helper.make_tensor_value_info(LOGITS_FROM, TensorProto.INT64, [1]))
    outs[0] = helper.make_tensor_value_info(
        "logits", TensorProto.FLOAT, ["batch", "logit_rows", spec.vocab]
    )
    graph_proto = helper.make_graph(g.nodes, f"sessiontape-{spec.name}", inputs, outs, g.inits)
    model = helper.make_model(
        graph_proto,
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(MS, 1)],
        producer_name="sessiontape",
    )
    model.ir_version = 8
    return model


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
