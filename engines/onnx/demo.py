"""The demo model: a small Llama-style decoder built deterministically in code.

No model hub is reachable where sessiontape is developed, so the project
builds its own model with numpy weights from a fixed seed and the ``onnx``
helper API (no torch). It follows the common decoder-only I/O convention::

    input_ids [b, s] int64, attention_mask [b, t] int64, position_ids [b, s] int64,
    past_key_values.N.key|value [b, kv_heads, t - s, head_dim] float32
    -> logits [b, s, vocab], present.N.key|value [b, kv_heads, t, head_dim],
       hidden_states.N [b, s, hidden]   (N = 0 embeddings, N = i after layer i)

That is the ``concat`` layout. The default ``static`` layout keeps the names
but not the growth: ``past_key_values.N.*`` and ``present.N.*`` are both
``[b, kv_heads, max_sequence_length, head_dim]``, one preallocated buffer;
the pass writes its new keys and values into it at ``position_ids``
(ScatterElements) and masks key slot j for the query at position q unless
j <= q. Bound to the same device buffer as past, present is updated in
place, and every pass has the same shapes however the history was built up
(what bit-exactness on a GPU needs; see docs/engines.md). onnxruntime-genai
runs it with ``past_present_share_buffer``.

RMSNorm, rotary positions (rotate-half), grouped-query attention (queries of
a KV group are folded into the row dimension, so the KV is never repeated)
and a SwiGLU MLP. Beside ``model.onnx`` the builder writes ``config.json``
(the shape facts and the byte tokenizer's specials), ``genai_config.json``
(so onnxruntime-genai can run the same file) and
``readout_concepts.json`` (the default concept directions).

Usage::

    path = build_demo("tiny", Path("/tmp/tiny"))   # -> /tmp/tiny/model.onnx
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from sessiontape.engines.model_spec import ModelSpec
from sessiontape.engines.onnx.decoder import build_static, graph_io, rope_rows
from sessiontape.engines.onnx.graph import Graph

#: byte tokenizer specials (the same ids as the reference engine)
BOS, EOS, PAD = 256, 257, 258
VOCAB = 259
BUILDER_VERSION = 6
#: KV layouts the builder emits: ``static`` (default) keeps one preallocated
#: buffer per layer and kind that a pass writes into at its positions (past
#: and present are the same tensor); ``concat`` is the classic growing cache
LAYOUTS = ("static", "concat")


@dataclass(frozen=True)
class DemoSpec:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    max_length: int
    vocab: int = VOCAB
    seed: int = 20240611
    rope_theta: float = 10000.0
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def params(self) -> int:
        h, hd = self.hidden, self.head_dim
        per_layer = h * h * 2 + 2 * h * self.kv_heads * hd + 3 * h * self.intermediate + 2 * h
        return self.vocab * h * 2 + self.layers * per_layer + h


SIZES: dict[str, DemoSpec] = {
    "tiny": DemoSpec(
        "tiny", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, max_length=2048
    ),
    "small": DemoSpec(
        "small", hidden=512, layers=8, heads=8, kv_heads=2, intermediate=1536, max_length=8192
    ),
}

F32 = npt.NDArray[np.float32]


def _weights(spec: DemoSpec) -> dict[str, F32]:
    rng = np.random.default_rng(spec.seed)
    h, hd, kvd = spec.hidden, spec.head_dim, spec.kv_heads * spec.head_dim

    def normal(shape: tuple[int, ...], std: float) -> F32:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    w: dict[str, F32] = {"embed": normal((spec.vocab, h), 1.0)}
    for i in range(spec.layers):
        p = f"l{i}."
        w[p + "attn_norm"] = (1.0 + normal((h,), 0.05)).astype(np.float32)
        w[p + "wq"] = normal((h, h), h**-0.5)
        w[p + "wk"] = normal((h, kvd), h**-0.5)
        w[p + "wv"] = normal((h, kvd), h**-0.5)
        w[p + "wo"] = normal((h, h), h**-0.5 / np.sqrt(2 * spec.layers))
        w[p + "mlp_norm"] = (1.0 + normal((h,), 0.05)).astype(np.float32)
        w[p + "wg"] = normal((h, spec.intermediate), h**-0.5)
        w[p + "wu"] = normal((h, spec.intermediate), h**-0.5)
        w[p + "wd"] = normal(
            (spec.intermediate, h), spec.intermediate**-0.5 / np.sqrt(2 * spec.layers)
        )
    w["final_norm"] = np.ones((h,), np.float32)
    # a peaked next-token distribution, so greedy decoding is not a coin toss
    w["lm_head"] = normal((h, spec.vocab), 2.5 * h**-0.5)
    inv = 1.0 / (spec.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    ang = np.outer(np.arange(rope_rows(spec.max_length), dtype=np.float64), inv)
    w["rope_cos"] = np.cos(ang).astype(np.float32)
    w["rope_sin"] = np.sin(ang).astype(np.float32)
    return w


def _build_graph(spec: DemoSpec, w: dict[str, F32], layout: str = "static") -> Any:
    """The model of ``layout``: :func:`_build_static`, or :func:`_build_concat`."""
    if layout == "static":
        return _build_static(spec, w)
    return _build_concat(spec, w)


@dataclass(frozen=True)
class _Pass:
    """What every layer of a concat-layout pass reads (names of graph values)."""

    #: reshape targets: queries of one KV group as rows, the scores by group and as rows,
    #: and the attention output by head
    gq_shape: str
    score5_shape: str
    score4_shape: str
    out_shape: str
    #: [b, 1, 1, s, t]: may query i attend to key j
    allowed: str
    #: the rotary tables' rows at the pass's positions
    cos: str
    sin: str


def _build_concat(spec: DemoSpec, w: dict[str, F32]) -> Any:
    """The classic concat graph: ``present`` is ``past`` with the pass's keys and values appended."""
    from onnx import helper

    g = Graph()
    for k, v in w.items():
        g.const(k, v)
    _concat_constants(g, spec)
    ps = _concat_pass(g, spec)
    x = g.op("Gather", ["embed", "input_ids"], axis=0)
    g.op("Identity", [x], name="hidden_states.0")
    for i in range(spec.layers):
        p = f"l{i}."
        x = g.op("Add", [x, _concat_attention(g, spec, i, _rmsnorm(g, x, p + "attn_norm"), ps)])
        x = g.op("Add", [x, _concat_mlp(g, i, _rmsnorm(g, x, p + "mlp_norm"))])
        g.op("Identity", [x], name=f"hidden_states.{i + 1}")
    g.op("MatMul", [_rmsnorm(g, x, "final_norm"), "lm_head"], name="logits")

    inputs, outs = graph_io(model_spec(spec), "past_sequence_length", "total_sequence_length")
    graph = helper.make_graph(g.nodes, f"sessiontape-demo-{spec.name}", inputs, outs, g.inits)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18)], producer_name="sessiontape"
    )
    model.ir_version = 8
    return model


def _concat_constants(g: Graph, spec: DemoSpec) -> None:
    """The scalars, axes and fixed reshape targets the concat graph's operators take."""
    nh, nkv, hd = spec.heads, spec.kv_heads, spec.head_dim
    g.i64("c_axis1", 1)
    g.i64("c_axis_neg1", -1)
    g.const("c_eps", np.array(spec.eps, np.float32))
    g.const("c_scale", np.array(hd**-0.5, np.float32))
    g.const("c_neginf", np.array(-np.inf, np.float32))
    g.i64("c_shape_q", 0, 0, nh, hd)
    g.i64("c_shape_kv", 0, 0, nkv, hd)
    g.i64("c_shape_h", 0, 0, spec.hidden)
    half = hd // 2
    g.i64("c_split", half, half)

    g.const("c_zero_s", np.array(0, np.int64))
    g.i64("c_axis0", 0)
    g.const("c_one_s", np.array(1, np.int64))


def _concat_pass(g: Graph, spec: DemoSpec) -> _Pass:
    """The pass's reshape targets from its dimensions, its attention mask and rotary rows."""
    from onnx import TensorProto

    nh, nkv, hd = spec.heads, spec.kv_heads, spec.head_dim
    group = nh // nkv
    ids_shape = g.op("Shape", ["input_ids"])
    batch = g.op("Gather", [ids_shape, "c_zero_s"], axis=0)
    seq = g.op("Gather", [ids_shape, "c_one_s"], axis=0)
    total = g.op("Gather", [g.op("Shape", ["attention_mask"]), "c_one_s"], axis=0)
    past = g.op("Sub", [total, seq])
    batch1 = g.op("Unsqueeze", [batch, "c_axis0"])
    seq1 = g.op("Unsqueeze", [seq, "c_axis0"])
    total1 = g.op("Unsqueeze", [total, "c_axis0"])
    # [b, kv_heads, group * s, head_dim]: the queries of one KV group as rows
    gq_shape = g.op(
        "Concat",
        [
            batch1,
            g.i64("c_nkv", nkv),
            g.op("Mul", [seq1, g.i64("c_group", group)]),
            g.i64("c_hd", hd),
        ],
        axis=0,
    )
    score5_shape = g.op(
        "Concat", [batch1, g.i64("c_nkv2", nkv), g.i64("c_group2", group), seq1, total1], axis=0
    )
    score4_shape = g.op(
        "Concat", [batch1, g.i64("c_nkv3", nkv), g.op("Mul", [seq1, "c_group"]), total1], axis=0
    )
    out_shape = g.op("Concat", [batch1, g.i64("c_nh", nh), seq1, g.i64("c_hd2", hd)], axis=0)

    # mask [b, 1, 1, s, t]: key j visible to query i iff j <= past + i and attention_mask[b, j]
    keys = g.op("Range", ["c_zero_s", total, "c_one_s"])
    qpos = g.op("Add", [g.op("Range", ["c_zero_s", seq, "c_one_s"]), past])
    causal = g.op(
        "LessOrEqual",
        [g.op("Unsqueeze", [keys, "c_axis0"]), g.op("Unsqueeze", [qpos, "c_axis_neg1"])],
    )
    padm = g.op("Cast", ["attention_mask"], to=TensorProto.BOOL)
    padm = g.op("Unsqueeze", [padm, g.i64("c_axes_123", 1, 2, 3)])
    allowed = g.op("And", [causal, padm])

    cos = g.op("Unsqueeze", [g.op("Gather", ["rope_cos", "position_ids"], axis=0), "c_axis1"])
    sin = g.op("Unsqueeze", [g.op("Gather", ["rope_sin", "position_ids"], axis=0), "c_axis1"])
    return _Pass(gq_shape, score5_shape, score4_shape, out_shape, allowed, cos, sin)


def _rope(g: Graph, ps: _Pass, x: str) -> str:
    """Rotary positions (rotate-half) applied to ``x`` [b, heads, s, head_dim]."""
    x1, x2 = g.op("Split", [x, "c_split"], outputs=2, axis=-1)
    a = g.op("Sub", [g.op("Mul", [x1, ps.cos]), g.op("Mul", [x2, ps.sin])])
    b = g.op("Add", [g.op("Mul", [x2, ps.cos]), g.op("Mul", [x1, ps.sin])])
    return str(g.op("Concat", [a, b], axis=-1))


def _rmsnorm(g: Graph, x: str, weight: str) -> str:
    """RMSNorm of ``x`` over its last axis, scaled by ``weight``."""
    ms = g.op("ReduceMean", [g.op("Mul", [x, x]), "c_axis_neg1"], keepdims=1)
    inv = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [ms, "c_eps"])])])
    return str(g.op("Mul", [g.op("Mul", [x, inv]), weight]))


def _concat_attention(g: Graph, spec: DemoSpec, i: int, xn: str, ps: _Pass) -> str:
    """Layer ``i``'s attention over past and new keys (writing ``present.i.*``), through ``wo``."""
    p = f"l{i}."
    q = g.op(
        "Transpose",
        [g.op("Reshape", [g.op("MatMul", [xn, p + "wq"]), "c_shape_q"])],
        perm=[0, 2, 1, 3],
    )
    k = g.op(
        "Transpose",
        [g.op("Reshape", [g.op("MatMul", [xn, p + "wk"]), "c_shape_kv"])],
        perm=[0, 2, 1, 3],
    )
    v = g.op(
        "Transpose",
        [g.op("Reshape", [g.op("MatMul", [xn, p + "wv"]), "c_shape_kv"])],
        perm=[0, 2, 1, 3],
    )
    q = g.op("Mul", [_rope(g, ps, q), "c_scale"])
    k = _rope(g, ps, k)
    pk = g.op("Concat", [f"past_key_values.{i}.key", k], axis=2, name=f"present.{i}.key")
    pv = g.op("Concat", [f"past_key_values.{i}.value", v], axis=2, name=f"present.{i}.value")
    qg = g.op("Reshape", [q, ps.gq_shape])
    scores = g.op("MatMul", [qg, g.op("Transpose", [pk], perm=[0, 1, 3, 2])])
    scores = g.op("Where", [ps.allowed, g.op("Reshape", [scores, ps.score5_shape]), "c_neginf"])
    probs = g.op("Reshape", [g.op("Softmax", [scores], axis=-1), ps.score4_shape])
    att = g.op("Reshape", [g.op("MatMul", [probs, pv]), ps.out_shape])
    att = g.op("Reshape", [g.op("Transpose", [att], perm=[0, 2, 1, 3]), "c_shape_h"])
    return str(g.op("MatMul", [att, p + "wo"]))


def _concat_mlp(g: Graph, i: int, xn: str) -> str:
    """Layer ``i``'s SwiGLU MLP."""
    p = f"l{i}."
    gate = g.op("MatMul", [xn, p + "wg"])
    act = g.op(
        "Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), g.op("MatMul", [xn, p + "wu"])]
    )
    return str(g.op("MatMul", [act, p + "wd"]))


def model_spec(spec: DemoSpec) -> ModelSpec:
    """The demo's shape as the graph builder's :class:`ModelSpec`."""
    return ModelSpec(
        name=f"demo-{spec.name}",
        hidden=spec.hidden,
        layers=spec.layers,
        heads=spec.heads,
        kv_heads=spec.kv_heads,
        intermediate=spec.intermediate,
        vocab=spec.vocab,
        max_length=spec.max_length,
        head_dim=spec.head_dim,
        rope_theta=spec.rope_theta,
        eps=spec.eps,
    )


def _build_static(spec: DemoSpec, w: dict[str, F32]) -> Any:
    """The static layout (:func:`sessiontape.engines.onnx.decoder.build_static`) over the demo's weights."""
    return build_static(model_spec(spec), w.__getitem__)


def default_concepts(spec: DemoSpec, w: dict[str, F32]) -> dict[str, Any]:
    """Concept directions: the mean embedding of a byte class, unit length, per readout layer."""
    classes = {
        "letters": [c for c in range(256) if chr(c).isalpha() and c < 128],
        "digits": list(range(48, 58)),
        "punctuation": [c for c in range(33, 127) if not chr(c).isalnum()],
        "whitespace": [9, 10, 13, 32],
    }
    layers = sorted({spec.layers // 2, spec.layers})
    vecs = []
    for _ in layers:
        row = []
        for ids in classes.values():
            d = w["embed"][ids].astype(np.float64).mean(axis=0)
            row.append([float(x) for x in d / np.linalg.norm(d)])
        vecs.append(row)
    return {
        "concepts": list(classes),
        "layers": layers,
        "hidden_size": spec.hidden,
        "directions": vecs,
    }


def build_demo(size: str, out_dir: Path, layout: str = "static") -> Path:
    """Build the demo model of ``size`` and KV ``layout`` into ``out_dir``; returns the model file path.

    Deterministic: the same size gives the same bytes. Writes to temporary
    names and renames, so a concurrent reader never sees a half-written file.
    """
    import onnx

    if size not in SIZES:
        raise ValueError(f"unknown demo size {size!r}; choose one of {sorted(SIZES)}")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown KV layout {layout!r}; choose one of {LAYOUTS}")
    spec = SIZES[size]
    out_dir.mkdir(parents=True, exist_ok=True)
    w = _weights(spec)
    model = _build_graph(spec, w, layout)
    onnx.checker.check_model(model)
    tmp = f".tmp{os.getpid()}"
    files: dict[str, bytes] = {
        "model.onnx": model.SerializeToString(),
        "config.json": _json(
            {
                "model_type": "sessiontape-demo",
                "builder_version": BUILDER_VERSION,
                **asdict(spec),
                "head_dim": spec.head_dim,
                "params": spec.params(),
                "bos_token_id": BOS,
                "eos_token_id": EOS,
                "pad_token_id": PAD,
                "vocab_size": spec.vocab,
                "tokenizer": "bytes",
                "kv_layout": layout,
            }
        ),
        "genai_config.json": _json(_genai_config(spec, layout)),
        "readout_concepts.json": _json(default_concepts(spec, w)),
    }
    # model.onnx last: its presence marks a complete build
    for name in sorted(files, key=lambda n: n == "model.onnx"):
        part = out_dir / (name + tmp)
        part.write_bytes(files[name])
        part.replace(out_dir / name)
    return out_dir / "model.onnx"


def _json(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def _genai_config(spec: DemoSpec, layout: str) -> dict[str, Any]:
    return {
        "model": {
            "bos_token_id": BOS,
            "eos_token_id": EOS,
            "pad_token_id": PAD,
            "context_length": spec.max_length,
            "vocab_size": spec.vocab,
            "type": "llama",
            "decoder": {
                "filename": "model.onnx",
                "head_size": spec.head_dim,
                "hidden_size": spec.hidden,
                "num_attention_heads": spec.heads,
                "num_hidden_layers": spec.layers,
                "num_key_value_heads": spec.kv_heads,
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "position_ids": "position_ids",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
            },
        },
        "search": {
            "do_sample": False,
            "max_length": spec.max_length,
            "min_length": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": layout == "static",
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
        },
    }


def cache_root() -> Path:
    env = os.environ.get("SESSIONTAPE_CACHE")
    base = Path(env) if env else Path.home() / ".cache" / "sessiontape"
    return base / "models"


def ensure_demo(size: str, root: Path | None = None, layout: str = "static") -> Path:
    """The demo model folder for ``size`` and ``layout``, building it on first use."""
    suffix = "" if layout == "static" else f"-{layout}"
    folder = (root or cache_root()) / f"{size}-v{BUILDER_VERSION}{suffix}"
    if not (folder / "model.onnx").exists():
        build_demo(size, folder, layout)
    return folder
