"""Fixtures for the engine tests: the tiny demo model, built once per test session."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from sessiontape.core.engine.interface import SamplingParams
from sessiontape.engines.onnx import OnnxEngine
from sessiontape.engines.onnx.demo import build_demo
from tests.helpers.engines import BUSY


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    build_demo("tiny", folder)
    return folder


@pytest.fixture(params=["default", "fixed", "neighbours"])
async def onnx_engine(tiny_dir: Path, request: pytest.FixtureRequest) -> AsyncIterator[OnnxEngine]:
    """The provider's default pass shape; a fixed one (4 rows over a full-length buffer,
    updated in place: the CUDA scheme) on whatever provider is present; and the default
    with other sessions generating on the same engine throughout the test (with a
    batching engine they share its passes), so every bit-exactness test also runs
    beside concurrent neighbours."""
    # one intra-op thread: the test machine is shared
    if request.param == "fixed":
        yield OnnxEngine(model_dir=tiny_dir, intra_op_threads=1, pass_rows=4)
        return
    eng = OnnxEngine(model_dir=tiny_dir, intra_op_threads=1)
    if request.param == "default":
        yield eng
        return
    BUSY.add(eng)
    task = asyncio.create_task(_neighbours(eng))
    try:
        yield eng
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await eng.aclose()


async def _neighbours(engine: OnnxEngine) -> None:
    """Three sessions generating forever: random lengths, sampling, cancellations."""
    rng = np.random.default_rng(2026)

    async def one(key: str) -> None:
        while True:
            hist = [int(t) for t in rng.integers(0, 256, int(rng.integers(3, 60)))]
            params = SamplingParams(
                max_tokens=int(rng.integers(1, 25)),
                temperature=float(rng.choice([0.0, 0.7, 1.2])),
                seed=int(rng.integers(0, 2**31)),
            )
            stop = int(rng.integers(1, 30))
            gen = engine.generate(key, hist, params)
            try:
                n = 0
                async for _ in gen:
                    n += 1
                    if n >= stop:
                        break
            finally:
                await gen.aclose()  # type: ignore[attr-defined]
            await asyncio.sleep(0)

    await asyncio.gather(*(one(f"neighbour-{i}") for i in range(3)))
