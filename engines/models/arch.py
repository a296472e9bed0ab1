"""Which architectures import, and their shape as the graph builder's :class:`ModelSpec`.

Served: the Llama family (Llama 2 and 3, SmolLM, TinyLlama), Mistral and
Qwen2, the decoders that the builder's graph computes exactly: RMSNorm,
rotary positions over the whole head (rotate-half), grouped-query
attention, a SiLU-gated MLP, and q/k/v biases for Qwen2. Anything else is
refused with :class:`UnsupportedModel` naming the feature (a mixture of
experts, a sliding window shorter than the context, partial rotary, rope
scaling other than ``linear`` and ``llama3``, another activation, biases
where the graph has none), never built into a model that computes
something else.

A sliding window at least as long as the served context never applies, so
such a model is served with its context capped at the window.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sessiontape.core.errors import UnsupportedModel
from sessiontape.engines.model_spec import ModelSpec, RopeScaling

#: GGUF ``general.architecture`` values served, and Hugging Face ``model_type`` values
GGUF_ARCHS = ("llama", "qwen2")
HF_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}


def _need(meta: Mapping[str, Any], key: str) -> Any:
    if key not in meta:
        raise UnsupportedModel(f"the model's metadata has no {key!r}")
    return meta[key]


def _rope_scaling(kind: str | None, factor: Any, extra: Mapping[str, Any]) -> RopeScaling | None:
    if kind in (None, "", "none", "default"):
        return None
    if kind not in ("linear", "llama3"):
        raise UnsupportedModel(
            f"rope scaling {kind!r} is not supported (served: none, linear, llama3)"
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
    if spec.heads % spec.kv_heads:
        raise UnsupportedModel(
            f"{spec.heads} attention heads do not split into {spec.kv_heads} KV groups"
        )
    if spec.head_dim % 2:
        raise UnsupportedModel(f"head size {spec.head_dim} is odd (rotary needs pairs)")
    return spec


def spec_from_gguf(meta: Mapping[str, Any], name: str) -> tuple[ModelSpec, bool]:
    """The spec of a GGUF file from its metadata, and whether Q and K rows are in llama.cpp's order.

    llama.cpp's converter reorders the rows of Llama's Q and K projections
    for its own rotary layout (``llama`` architecture only); the importer puts
    them back.
    """
    arch = str(_need(meta, "general.architecture"))
    if arch not in GGUF_ARCHS:
        raise UnsupportedModel(
            f"GGUF architecture {arch!r} is not supported (served: {', '.join(GGUF_ARCHS)})"
        )
    if int(meta.get(f"{arch}.expert_count", 0) or 0) > 0:
        raise UnsupportedModel("mixture-of-experts models are not supported")
    hidden = int(_need(meta, f"{arch}.embedding_length"))
    heads = int(_need(meta, f"{arch}.attention.head_count"))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    if int(meta.get(f"{arch}.attention.value_length", head_dim)) != head_dim:
        raise UnsupportedModel("keys and values of different sizes are not supported")
    rot = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rot != head_dim:
        raise UnsupportedModel(f"partial rotary ({rot} of {head_dim} dimensions) is not supported")
    context = int(_need(meta, f"{arch}.context_length"))
    window = meta.get(f"{arch}.attention.sliding_window")
    if window:
        context = min(context, int(window))
    kind = meta.get(f"{arch}.rope.scaling.type")
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
    spec = ModelSpec(
        name=name,
        hidden=hidden,
        layers=int(_need(meta, f"{arch}.block_count")),
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
    )
    return _check(spec), arch == "llama"


def spec_from_hf(config: Mapping[str, Any], name: str) -> tuple[ModelSpec, bool]:
    """The spec of a Hugging Face checkpoint from its ``config.json``, and whether embeddings are tied."""
    mtype = str(config.get("model_type", ""))
    if mtype not in HF_TYPES:
        raise UnsupportedModel(
            f"model_type {mtype!r} is not supported (served: {', '.join(sorted(HF_TYPES))})"
        )
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModel(f"activation {act!r} is not supported (served: silu)")
    if config.get("mlp_bias") or (mtype != "qwen2" and config.get("attention_bias")):
        raise UnsupportedModel("attention or MLP biases are not supported for this architecture")
    if config.get("num_local_experts") or config.get("num_experts"):
        raise UnsupportedModel("mixture-of-experts models are not supported")
    hidden = int(_need(config, "hidden_size"))
    heads = int(_need(config, "num_attention_heads"))
    context = int(config.get("max_position_embeddings", 2048))
    window = config.get("sliding_window")
    if window and (mtype != "qwen2" or config.get("use_sliding_window")):
        context = min(context, int(window))
    rs = config.get("rope_scaling") or {}
    if not isinstance(rs, Mapping):
        raise UnsupportedModel(f"rope_scaling must be an object, not {rs!r}")
    kind = rs.get("rope_type", rs.get("type"))
    spec = ModelSpec(
        name=name,
        hidden=hidden,
        layers=int(_need(config, "num_hidden_layers")),
        heads=heads,
        kv_heads=int(config.get("num_key_value_heads") or heads),
        intermediate=int(_need(config, "intermediate_size")),
        vocab=int(_need(config, "vocab_size")),
        max_length=context,
        head_dim=int(config.get("head_dim") or hidden // heads),
        rope_theta=float(config.get("rope_theta", 10000.0)),
        eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_scaling=_rope_scaling(None if kind is None else str(kind), rs.get("factor"), rs),
        qkv_bias=mtype == "qwen2",
    )
    return _check(spec), bool(config.get("tie_word_embeddings", False))
