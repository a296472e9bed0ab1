"""The shape of a model as the importer reads it and the graph builder writes it.

:class:`ModelSpec` is what both sides of an import agree on: the importer
(:mod:`sessiontape.engines.models.arch`) describes a GGUF file or a Hugging Face
checkpoint as one, and the decoder graph builder
(:mod:`sessiontape.engines.onnx.decoder`) writes the ONNX graph from it. The weights
travel as :mod:`sessiontape.engines.weights`' types. Neither side imports the other.

Beside the Llama block, the spec switches on what Qwen3, Gemma 2/3, Phi-3 and
Mistral add (:class:`ModelSpec`): per-head RMSNorm of q and k before the
rotary (``qk_norm``), norms after the attention and the MLP (``post_norms``),
the embedding scaled by a constant (``embed_scale``), a GELU-tanh gated MLP
(``activation``), a query scale other than ``head_dim ** -0.5``
(``query_scale``), soft-capped attention scores and logits (``cap * tanh(x /
cap)``), sliding-window layers (``sliding_window``, ``local_layers``: a query at
position p sees keys at p - window < j <= p) with their own rotary base
(``local_rope_theta``), and Phi-3's long-rope scaling (short and long frequency
divisors by position, and a factor on the rotary tables, ``rope_attention_factor``). The key/value buffers hold every position on every
layer, so a window is a mask over positions and stays exact however long the
sequence grows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

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
    """The shape of a decoder: the Llama block and the features of Qwen2/3, Gemma 2/3, Phi-3
    and Mistral (the module docstring)."""

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
    #: Phi-3's long-rope scaling: the positions from ``rope_long_from`` on take these
    #: divisors in place of ``rope_freq_factors`` (the short factors), as transformers'
    #: decode steps past ``original_max_position_embeddings`` do
    rope_long_factors: tuple[float, ...] | None = None
    rope_long_from: int = 0
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


def is_local(spec: ModelSpec, i: int) -> bool:
    return spec.sliding_window > 0 and i in spec.local_layers


#: the MLP activations the graph computes
ACTIVATIONS = ("silu", "gelu_tanh")


def check_features(spec: ModelSpec) -> None:
    if spec.activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}")
    if spec.sliding_window < 0 or any(not 0 <= i < spec.layers for i in spec.local_layers):
        raise ValueError("a sliding window needs a positive size and layers of the model")
    for cap in (spec.attn_softcap, spec.final_softcap):
        if cap is not None and not cap > 0:
            raise ValueError(f"a soft cap must be positive, not {cap}")
