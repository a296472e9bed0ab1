"""Fixtures for the engine tests: the tiny demo model, built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.onnx import OnnxEngine
from engines.onnx.demo import build_demo


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    build_demo("tiny", folder)
    return folder


@pytest.fixture(params=["default", "fixed"])
def onnx_engine(tiny_dir: Path, request: pytest.FixtureRequest) -> OnnxEngine:
    """The provider's default pass shape, and a fixed one (4 rows over a full-length buffer,
    updated in place: the CUDA scheme) on whatever provider is present."""
    # one intra-op thread: the test machine is shared
    if request.param == "fixed":
        return OnnxEngine(model_dir=tiny_dir, intra_op_threads=1, pass_rows=4)
    return OnnxEngine(model_dir=tiny_dir, intra_op_threads=1)
