"""Which architectures import, and their shape as the graph builder's :class:`ModelSpec`.

Served, from a GGUF file (``general.architecture``) or a Hugging Face folder
(``model_type`` in ``config.json``) alike:

- the Llama family (Llama 2 and 3.x, SmolLM, TinyLlama; rope scaling ``linear``
  and ``llama3``, or llama.cpp's ``rope_freqs``), Mistral (a sliding window on
  every layer), Qwen2/2.5 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm);
- Gemma 2 and Gemma 3: the embedding scaled by sqrt(hidden), ``(1 + w)`` norms
  (llama.cpp's converter stores ``1 + w``; a Hugging Face source's weights get
  the 1 added on import), norms after the attention and the MLP, a GELU-tanh
  gated MLP, the query scaled by ``query_pre_attn_scalar``, sliding-window layers
  beside global ones (Gemma 2: every other layer; Gemma 3: five of six, with
  their own rotary base), soft-capped attention scores and logits (Gemma 2;
  Gemma 3's final cap when set), Gemma 3's q/k norms;
- Phi-3 (fused q|k|v and gate|up matrices, split on import; long-rope scaling: the
  short factors up to the original length, the long ones from there on).

Everything is read from the header or ``config.json`` alone, so anything else
is refused with :class:`UnsupportedModel` naming what is missing (another
architecture, a mixture of experts, partial rotary, rope scaling other than
those above, another activation, biases where the graph has none,
bidirectional attention), never built into a model that computes something
else.

How each architecture names its tensors in either format, and which of them
are fused, is a :class:`Family`; the sources (sources.py) read by it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sessiontape.core.errors import UnsupportedModel
from sessiontape.engines.model_spec import ModelSpec, RopeScaling

_LLAMA_GGUF = {
    "attn_norm": "attn_norm.weight",
    "wq": "attn_q.weight",
    "wk": "attn_k.weight",
    "wv": "attn_v.weight",
    "bq": "attn_q.bias",
    "bk": "attn_k.bias",
    "bv": "attn_v.bias",
    "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight",
    "wo": "attn_output.weight",
    "mlp_norm": "ffn_norm.weight",
    "wg": "ffn_gate.weight",
    "wu": "ffn_up.weight",
    "wd": "ffn_down.weight",
}
_LLAMA_HF = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "wo": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "wg": "mlp.gate_proj.weight",
    "wu": "mlp.up_proj.weight",
    "wd": "mlp.down_proj.weight",
}
#: the builder's per-layer norm weights (a Gemma source adds 1 to a Hugging Face one)
NORMS = ("attn_norm", "mlp_norm", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm")
#: the builder's per-layer vectors (everything else per layer is a matrix)
VECTORS = (*NORMS, "bq", "bk", "bv")


@dataclass(frozen=True)
class Family:
    """How one architecture's per-layer tensors are named, in GGUF (within ``blk.N.``) and
    in a Hugging Face checkpoint (within ``layers.N.``), by the builder's names."""

    name: str
    gguf: Mapping[str, str] = field(default_factory=lambda: _LLAMA_GGUF)
    hf: Mapping[str, str] = field(default_factory=lambda: _LLAMA_HF)
    #: added to a Hugging Face checkpoint's norm weights (Gemma's ``1 + w``; llama.cpp's
    #: converter has added it already)
    hf_norm_shift: float = 0.0
    #: llama.cpp reorders the rows of Q and K for its rotary layout (``llama`` only)
    gguf_permute_qk: bool = False
    #: matrices stored fused: builder name -> (fused name, index of its rows' part)
    fused: Mapping[str, tuple[str, int]] = field(default_factory=dict)

    def fused_rows(self, spec: ModelSpec, part: str) -> tuple[str, int, int, int] | None:
        """(fused name, first row, end row, the fused matrix's rows) of ``part``, or None
        when ``part`` is not stored fused."""
        if part not in self.fused:
            return None
        whole, index = self.fused[part]
        q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
        sizes = {"wqkv": [q, kv, kv], "wgu": [spec.intermediate, spec.intermediate]}[whole]
        start = sum(sizes[:index])
        return whole, start, start + sizes[index], sum(sizes)


_GEMMA_GGUF = {
    **_LLAMA_GGUF,
    "post_attn_norm": "post_attention_norm.weight",
    "post_mlp_norm": "post_ffw_norm.weight",
}
_GEMMA_HF = {
    **_LLAMA_HF,
    "post_attn_norm": "post_attention_layernorm.weight",
    "mlp_norm": "pre_feedforward_layernorm.weight",
    "post_mlp_norm": "post_feedforward_layernorm.weight",
}
_PHI3_FUSED = {
    "wq": ("wqkv", 0),
    "wk": ("wqkv", 1),
    "wv": ("wqkv", 2),
    "wg": ("wgu", 0),
    "wu": ("wgu", 1),
}
FAMILIES = {
    "llama": Family("llama", gguf_permute_qk=True),
    "qwen2": Family("qwen2"),
    "qwen3": Family("qwen3"),
    "gemma2": Family("gemma2", _GEMMA_GGUF, _GEMMA_HF, hf_norm_shift=1.0),
    "gemma3": Family("gemma3", _GEMMA_GGUF, _GEMMA_HF, hf_norm_shift=1.0),
    "phi3": Family(
        "phi3",
        # llama.cpp keeps Phi-3's gate|up matrix fused under ffn_up's name
        {**_LLAMA_GGUF, "wqkv": "attn_qkv.weight", "wgu": "ffn_up.weight"},
        {**_LLAMA_HF, "wqkv": "self_attn.qkv_proj.weight", "wgu": "mlp.gate_up_proj.weight"},
        fused=_PHI3_FUSED,
    ),
}
#: GGUF ``general.architecture`` values served (Mistral's converter writes ``llama``)
GGUF_ARCHS = tuple(FAMILIES)
#: Hugging Face ``model_type`` values served, and their family
HF_TYPES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
}
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")
_GEMMA_DEFAULTS = {
    "vocab_size": 256000,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
}
#: what transformers' Gemma2Config and Gemma3TextConfig take for a key a config leaves out
#: (a multimodal Gemma 3's text_config lists only what differs); an explicit null stays null
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": _GEMMA_DEFAULTS,
    "gemma3": _GEMMA_DEFAULTS
    | {
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    },
}


def _need(meta: Mapping[str, Any], key: str) -> Any:
    if key not in meta:
        raise UnsupportedModel(f"the model's metadata has no {key!r}")
    return meta[key]


def _rope_scaling(kind: str | None, factor: Any, extra: Mapping[str, Any]) -> RopeScaling | None:
    if kind in (None, "", "none", "default"):
        return None
    if kind not in ("linear", "llama3"):
        raise UnsupportedModel(
            f"rope scaling {kind!r} is not supported (served: none, linear, llama3; "
            "Phi-3's longrope)"
        )
    if not isinstance(factor, int | float) or factor <= 0:
        raise UnsupportedModel(f"rope scaling {kind!r} needs a positive factor, not {factor!r}")
    if kind == "linear":
        return RopeScaling("linear", float(factor))
    return RopeScaling(
        "llama3",
        float(factor),
        float(extra.get("low_freq_factor", 1.0)),
        float(extra.get("high_freq_factor", 4.0)),
        int(extra.get("original_max_position_embeddings", 8192)),
    )


def _check(spec: ModelSpec) -> ModelSpec:
    for what in ("hidden", "layers", "heads", "kv_heads", "intermediate", "head_dim", "max_length"):
        if getattr(spec, what) <= 0:
            raise UnsupportedModel(f"the model's {what} is {getattr(spec, what)}, not positive")
    if spec.heads % spec.kv_heads:
        raise UnsupportedModel(
            f"{spec.heads} attention heads do not split into {spec.kv_heads} KV groups"
        )
    if spec.head_dim % 2:
        raise UnsupportedModel(f"head size {spec.head_dim} is odd (rotary needs pairs)")
    if spec.sliding_window < 0:
        raise UnsupportedModel(f"sliding window {spec.sliding_window} is negative")
    return spec


def _windowed(spec: ModelSpec, window: int, local: Sequence[int]) -> ModelSpec:
    """``spec`` with a sliding window over ``local`` layers (none where the window covers
    the whole context, which it then never limits)."""
    from dataclasses import replace

    if window <= 0 or window >= spec.max_length or not local:
        return spec
    return replace(spec, sliding_window=int(window), local_layers=tuple(sorted(local)))


def _every_other(layers: int, period: int) -> list[int]:
    """The local layers of a pattern of ``period`` layers whose last is global (as
    transformers' and llama.cpp's: layer i is local iff (i + 1) % period != 0)."""
    return [i for i in range(layers) if (i + 1) % period]


def _gemma_query_scale(layers: int, big: int, hidden: int, heads: int, head_dim: int) -> float:
    """llama.cpp's Gemma 2/3 query scale from a GGUF (which has no query_pre_attn_scalar):
    hidden / heads for the 27B models (``big`` layers), else head_dim."""
    return 1.0 / math.sqrt(hidden // heads if layers == big else head_dim)


def spec_from_gguf(meta: Mapping[str, Any], name: str) -> tuple[ModelSpec, Family]:
    """The spec of a GGUF file from its metadata, and how its tensors are named and stored.

    A value of the wrong type is refused (UnsupportedModel, with the conversion's message),
    as is a size that is not positive."""
    try:
        return _spec_from_gguf(meta, name)
    except (TypeError, ValueError, ArithmeticError) as exc:
        raise UnsupportedModel(f"the GGUF metadata is malformed: {exc}") from exc


def _spec_from_gguf(meta: Mapping[str, Any], name: str) -> tuple[ModelSpec, Family]:
    arch = str(_need(meta, "general.architecture"))
    if arch not in FAMILIES:
        raise UnsupportedModel(
            f"GGUF architecture {arch!r} is not supported (served: {', '.join(GGUF_ARCHS)})"
        )
    family = FAMILIES[arch]
    if int(meta.get(f"{arch}.expert_count", 0) or 0) > 0:
        raise UnsupportedModel("mixture-of-experts models are not supported")
    hidden = int(_need(meta, f"{arch}.embedding_length"))
    heads = int(_need(meta, f"{arch}.attention.head_count"))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    if int(meta.get(f"{arch}.attention.value_length", head_dim)) != head_dim:
        raise UnsupportedModel("keys and values of different sizes are not supported")
    for key in ("key_length_swa", "value_length_swa"):
        if int(meta.get(f"{arch}.attention.{key}", head_dim)) != head_dim:
            raise UnsupportedModel(f"a different head size on sliding-window layers ({key})")
    rot = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rot != head_dim:
        raise UnsupportedModel(f"partial rotary ({rot} of {head_dim} dimensions) is not supported")
    layers = int(_need(meta, f"{arch}.block_count"))
    context = int(_need(meta, f"{arch}.context_length"))
    kind = meta.get(f"{arch}.rope.scaling.type")
    scaling = None
    if arch != "phi3" or kind not in ("longrope", "su"):  # Phi-3's: its factors are tensors
        scaling = _rope_scaling(
            None if kind is None else str(kind),
            meta.get(f"{arch}.rope.scaling.factor"),
            {
                "original_max_position_embeddings": meta.get(
                    f"{arch}.rope.scaling.original_context_length", 8192
                )
            },
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = int(meta.get(f"{arch}.vocab_size", len(tokens) if tokens else 0))
    gemma = arch in ("gemma2", "gemma3")
    spec = ModelSpec(
        name=name,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=int(_need(meta, f"{arch}.feed_forward_length")),
        vocab=vocab,
        max_length=context,
        head_dim=head_dim,
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_scaling=scaling,
        qkv_bias=arch == "qwen2",
        qk_norm=arch in ("qwen3", "gemma3"),
        post_norms=gemma,
        embed_scale=math.sqrt(hidden) if gemma else None,
        activation="gelu_tanh" if gemma else "silu",
        query_scale=(
            _gemma_query_scale(layers, 46 if arch == "gemma2" else 62, hidden, heads, head_dim)
            if gemma
            else None
        ),
        attn_softcap=_cap(meta.get(f"{arch}.attn_logit_softcapping")),
        final_softcap=_cap(meta.get(f"{arch}.final_logit_softcapping")),
    )
    return _check(_gguf_window(meta, arch, spec)), family


def _gguf_window(meta: Mapping[str, Any], arch: str, spec: ModelSpec) -> ModelSpec:
    """``spec`` with a GGUF's sliding window: on every layer (Mistral, Phi-3), every other
    (Gemma 2) or five of six (Gemma 3, whose local layers have their own rotary base), as
    llama.cpp lays them out unless the file lists them (``sliding_window_pattern``)."""
    from dataclasses import replace

    layers = spec.layers
    window = int(meta.get(f"{arch}.attention.sliding_window") or 0)
    local = list(range(layers))
    if arch == "gemma2":
        window = window or 4096  # llama.cpp's default for Gemma 2
        local = _every_other(layers, 2)
    elif arch == "gemma3":
        local = _every_other(layers, 6)
        if window:
            base = meta.get(f"{arch}.rope.freq_base_swa", 10000.0)
            spec = replace(spec, local_rope_theta=float(base))
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):  # per layer: true where the layer is local
        local = [i for i, is_local in enumerate(pattern) if is_local]
    elif isinstance(pattern, int) and pattern > 0:
        local = _every_other(layers, pattern) if pattern > 1 else []
    return _windowed(spec, window, local)


def _cap(value: Any) -> float | None:
    if value is None or value == 0:
        return None
    if not isinstance(value, int | float) or value < 0:
        raise UnsupportedModel(f"a logit soft cap must be a positive number, not {value!r}")
    return float(value)


def spec_from_hf(config: Mapping[str, Any], name: str) -> tuple[ModelSpec, Family, bool]:
    """The spec of a Hugging Face checkpoint from its ``config.json``, its family, and
    whether its output head is the embedding (tied); a malformed value is refused
    (UnsupportedModel)."""
    try:
        return _spec_from_hf(config, name)
    except (TypeError, ValueError, ArithmeticError, AttributeError) as exc:
        raise UnsupportedModel(f"config.json is malformed: {exc}") from exc


def _spec_from_hf(config: Mapping[str, Any], name: str) -> tuple[ModelSpec, Family, bool]:
    mtype = str(config.get("model_type", ""))
    if mtype not in HF_TYPES:
        raise UnsupportedModel(
            f"model_type {mtype!r} is not supported (served: {', '.join(sorted(HF_TYPES))})"
        )
    family = FAMILIES[HF_TYPES[mtype]]
    outer = config
    if mtype == "gemma3" and isinstance(config.get("text_config"), Mapping):
        config = {**config["text_config"], "model_type": "gemma3_text"}
    fam = family.name
    config = {**HF_DEFAULTS.get(fam, {}), **config}
    gemma = fam in ("gemma2", "gemma3")
    want = _hf_activation(config, mtype, gemma)
    if config.get("mlp_bias") or (fam != "qwen2" and config.get("attention_bias")):
        raise UnsupportedModel("attention or MLP biases are not supported for this architecture")
    if config.get("num_local_experts") or config.get("num_experts"):
        raise UnsupportedModel("mixture-of-experts models are not supported")
    if config.get("use_bidirectional_attention"):
        raise UnsupportedModel("bidirectional attention is not supported (served: causal)")
    partial = config.get("partial_rotary_factor", 1.0)
    if partial not in (None, 1, 1.0):
        raise UnsupportedModel(f"partial rotary (factor {partial}) is not supported")
    hidden = int(_need(config, "hidden_size"))
    heads = int(_need(config, "num_attention_heads"))
    head_dim = int(config.get("head_dim") or hidden // heads)
    layers = int(_need(config, "num_hidden_layers"))
    context = int(config.get("max_position_embeddings", 2048))
    theta, rs = _hf_rope(config, fam)
    kind = rs.get("rope_type", rs.get("type"))
    kind = None if kind is None else str(kind)
    longrope: Mapping[str, Any] = {}
    scaling = None
    if fam == "phi3" and kind in ("longrope", "su"):
        longrope = _longrope(config, rs, head_dim)
    else:
        scaling = _rope_scaling(kind, rs.get("factor"), rs)
    spec = ModelSpec(
        name=name,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=int(config.get("num_key_value_heads") or heads),
        intermediate=int(_need(config, "intermediate_size")),
        vocab=int(_need(config, "vocab_size")),
        max_length=context,
        head_dim=head_dim,
        rope_theta=theta,
        eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_scaling=scaling,
        **longrope,
        qkv_bias=fam == "qwen2",
        qk_norm=fam in ("qwen3", "gemma3"),
        post_norms=gemma,
        embed_scale=math.sqrt(hidden) if gemma else None,
        activation=want,
        query_scale=float(config["query_pre_attn_scalar"]) ** -0.5 if gemma else None,
        attn_softcap=_cap(config.get("attn_logit_softcapping")) if gemma else None,
        final_softcap=_cap(config.get("final_logit_softcapping")) if gemma else None,
    )
    window, local = _hf_window(config, fam, layers)
    if fam == "gemma3" and window:
        from dataclasses import replace

        spec = replace(spec, local_rope_theta=_hf_local_theta(config))
    tied_default = gemma
    tied = bool(outer.get("tie_word_embeddings", config.get("tie_word_embeddings", tied_default)))
    return _check(_windowed(spec, window, local)), family, tied


def _hf_activation(config: Mapping[str, Any], mtype: str, gemma: bool) -> str:
    """The MLP's activation (Gemma: GELU-tanh, the others SiLU), or UnsupportedModel."""
    act = config.get("hidden_activation") or config.get("hidden_act", "silu")
    if gemma and act in _GELU_TANH:
        return "gelu_tanh"
    if not gemma and act == "silu":
        return "silu"
    served = "gelu_pytorch_tanh" if gemma else "silu"
    raise UnsupportedModel(f"activation {act!r} is not supported for {mtype} (served: {served})")


def _hf_rope(config: Mapping[str, Any], fam: str) -> tuple[float, Mapping[str, Any]]:
    """(rope_theta, the global layers' rope scaling) from ``rope_theta`` and
    ``rope_scaling``, or the newer ``rope_parameters`` (per layer type for Gemma 3)."""
    params = config.get("rope_parameters")
    if isinstance(params, Mapping) and isinstance(params.get("full_attention"), Mapping):
        params = params["full_attention"]
    rs = config.get("rope_scaling") or (params if isinstance(params, Mapping) else {}) or {}
    if not isinstance(rs, Mapping):
        raise UnsupportedModel(f"rope_scaling must be an object, not {rs!r}")
    theta = config.get("rope_theta")
    if theta is None and isinstance(params, Mapping):
        theta = params.get("rope_theta")
    default = 1_000_000.0 if fam == "gemma3" else 10000.0
    return float(theta if theta is not None else default), rs


def _hf_local_theta(config: Mapping[str, Any]) -> float:
    params = config.get("rope_parameters")
    if isinstance(params, Mapping) and isinstance(params.get("sliding_attention"), Mapping):
        local = params["sliding_attention"]
        if local.get("rope_type", "default") not in ("default", None):
            raise UnsupportedModel("rope scaling on sliding-window layers is not supported")
        return float(local.get("rope_theta", 10000.0))
    return float(config.get("rope_local_base_freq", 10000.0))


def _hf_window(config: Mapping[str, Any], fam: str, layers: int) -> tuple[int, list[int]]:
    """The sliding window and its layers, as transformers reads them (``layer_types`` when
    the config lists them)."""
    window = int(config.get("sliding_window") or 0)
    if fam in ("qwen2", "qwen3") and not config.get("use_sliding_window"):
        window = 0
    types = config.get("layer_types")
    if isinstance(types, list):
        if len(types) != layers or any(
            t not in ("sliding_attention", "full_attention") for t in types
        ):
            raise UnsupportedModel(f"layer_types {types!r} are not supported")
        return window, [i for i, t in enumerate(types) if t == "sliding_attention"]
    if fam == "gemma2":
        return window or 4096, _every_other(layers, 2)
    if fam == "gemma3":
        period = int(config.get("sliding_window_pattern", 6) or 6)
        return window, _every_other(layers, period) if period > 1 else []
    if fam in ("qwen2", "qwen3"):
        start = int(config.get("max_window_layers", layers))
        return window, list(range(start, layers))
    return window, list(range(layers))


def _longrope(config: Mapping[str, Any], rs: Mapping[str, Any], head_dim: int) -> Mapping[str, Any]:
    """Phi-3's long-rope scaling from ``config.json``, as transformers'
    ``_compute_longrope_parameters`` reads it: the short and long factors, the original
    length (the long factors' first position) and the attention factor on cos and sin
    (``attention_factor``, else ``sqrt(1 + ln(s) / ln(original))`` for s =
    max_position_embeddings / original > 1, else 1)."""
    original = int(config.get("original_max_position_embeddings") or 0)
    context = int(config.get("max_position_embeddings", original))
    short, long = rs.get("short_factor"), rs.get("long_factor")
    half = head_dim // 2
    if (
        not original
        or not isinstance(short, list)
        or not isinstance(long, list)
        or len(short) != half
        or len(long) != half
    ):
        raise UnsupportedModel(
            f"longrope scaling needs original_max_position_embeddings and {half} short "
            f"and {half} long factors"
        )
    return _longrope_fields(short, long, original, context, rs.get("attention_factor"))


def _longrope_fields(
    short: Sequence[float], long: Sequence[float], original: int, context: int, attention: Any
) -> Mapping[str, Any]:
    """The ModelSpec fields of a long-rope scaling."""
    for what, factors in (("short", short), ("long", long)):
        if not all(isinstance(x, int | float) and x > 0 for x in factors):
            raise UnsupportedModel(f"longrope {what} factors must be positive numbers")
    if original <= 0:
        raise UnsupportedModel(f"longrope original length {original} is not positive")
    if attention is None:
        factor = context / original
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    return {
        "rope_freq_factors": tuple(float(x) for x in short),
        "rope_long_factors": tuple(float(x) for x in long),
        "rope_long_from": original,
        "rope_attention_factor": float(attention),
    }


def longrope_from_gguf(
    meta: Mapping[str, Any], spec: ModelSpec, short: Sequence[float], long: Sequence[float]
) -> ModelSpec:
    """A Phi-3 GGUF's spec with its long-rope scaling: ``rope_factors_short`` and
    ``rope_factors_long`` (read from the file), the original length
    (``phi3.rope.scaling.original_context_length``) and the attention factor
    (``phi3.rope.scaling.attn_factor``, else computed as transformers does)."""
    from dataclasses import replace

    half = spec.head_dim // 2
    if len(short) != half or len(long) != half:
        raise UnsupportedModel(
            f"rope_factors_short and rope_factors_long hold {len(short)} and {len(long)} "
            f"factors, not {half}"
        )
    arch = str(meta.get("general.architecture"))
    original = int(meta.get(f"{arch}.rope.scaling.original_context_length") or spec.max_length)
    fields = _longrope_fields(
        short, long, original, spec.max_length, meta.get(f"{arch}.rope.scaling.attn_factor")
    )
    return replace(spec, **fields)
