"""Llama 3.1's rope scaling as a GGUF stores it: llama.cpp's ``rope_freqs`` tensor.

Each rotary frequency is divided by its factor, so factors of 2 everywhere are linear
scaling by 2, and factors of 1 change nothing; a wrong count is refused.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sessiontape.core.errors import UnsupportedModel
from sessiontape.engines.onnx.importer import import_model
from tests.helpers import checkpoints as ck

IDS = [3, 17, 101, 7, 250, 42, 9, 88, 120, 5, 64, 33]


def logits(src: Path, out: Path) -> np.ndarray:
    folder = import_model(src, out, "float32", concepts=False).folder
    return np.asarray(ck.run_imported(folder, IDS))


def test_rope_freqs_divide_the_frequencies(tmp_path: Path) -> None:
    arch, w = ck.LLAMA, ck.random_weights(ck.LLAMA)
    half = arch.head_dim // 2
    plain = tmp_path / "plain.gguf"
    ck.write_gguf(plain, arch, w)
    ones = tmp_path / "ones.gguf"
    ck.write_gguf(ones, arch, w, extra_tensors={"rope_freqs.weight": np.ones(half, np.float32)})
    twos = tmp_path / "twos.gguf"
    ck.write_gguf(twos, arch, w, extra_tensors={"rope_freqs.weight": np.full(half, 2, np.float32)})
    linear = tmp_path / "linear.gguf"
    ck.write_gguf(
        linear, arch, w, extra={"rope.scaling.type": "linear", "rope.scaling.factor": 2.0}
    )
    base = logits(plain, tmp_path / "a")
    assert np.abs(logits(ones, tmp_path / "b") - base).max() < 1e-6
    scaled = logits(twos, tmp_path / "c")
    assert np.abs(scaled - logits(linear, tmp_path / "d")).max() < 1e-5
    assert np.abs(scaled - base).max() > 1e-2  # the factors are applied, not ignored


def test_a_wrong_number_of_rope_freqs_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "bad.gguf"
    ck.write_gguf(
        src,
        ck.LLAMA,
        ck.random_weights(ck.LLAMA),
        extra_tensors={"rope_freqs.weight": np.ones(3, np.float32)},
    )
    with pytest.raises(UnsupportedModel, match="rope_freqs"):
        import_model(src, tmp_path / "out", "float32", concepts=False)
