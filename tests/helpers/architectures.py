"""The importer's tests' fixed inputs: the architectures, a token sequence, their seeded weights, and a graph's operators."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx

from tests.helpers import checkpoints as ck
from tests.helpers.checkpoints import LLAMA, MISTRAL, QWEN2, Arch, Weights

# 24 tokens: BOS, then seeded draws over the bytes and merges, the end-of-turn token inside
IDS = [ck.BOS_ID, *(int(i) for i in np.random.default_rng(7).integers(0, ck.VOCAB, 22)), ck.EOS_ID]


IDS[12] = ck.EOS_ID


ARCHS = {a.name: a for a in (LLAMA, QWEN2, MISTRAL)}


_WEIGHTS: dict[str, Weights] = {}


def weights(arch: Arch) -> Weights:
    if arch.name not in _WEIGHTS:
        _WEIGHTS[arch.name] = ck.random_weights(arch)
    return _WEIGHTS[arch.name]


def op_counts(folder: Path, name: str = "model.onnx") -> Counter[str]:
    model = onnx.load(str(folder / name), load_external_data=False)
    return Counter(str(n.op_type) for n in model.graph.node)
