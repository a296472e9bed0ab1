"""Driving the ONNX engine in tests: a generation's tokens, a seeded history."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sessiontape.core.engine.interface import OutputOptions, SamplingParams, Step
from sessiontape.engines.onnx import OnnxEngine


async def collect(
    engine: OnnxEngine,
    key: str,
    history: Sequence[int],
    params: SamplingParams,
    options: OutputOptions | None = None,
) -> list[Step]:
    return [s async for s in engine.generate(key, history, params, options or OutputOptions())]


def history(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]
