"""The shape of a model as the importer reads it and the graph builder writes it.

:class:`ModelSpec` is what both sides of an import agree on: the importer
(:mod:`sessiontape.engines.models.arch`) describes a GGUF file or a Hugging Face
checkpoint as one, and the decoder graph builder
(:mod:`sessiontape.engines.onnx.decoder`) writes the ONNX graph from it. The weights
travel as :mod:`sessiontape.engines.weights`' types. Neither side imports the other.
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
