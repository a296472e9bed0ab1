"""Engines under test: which ones have busy neighbours, and a call made to fail once."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

from sessiontape.engines.onnx import OnnxEngine

#: engines that other sessions are generating on while a test runs
BUSY: weakref.WeakSet[OnnxEngine] = weakref.WeakSet()


def alone_only(engine: OnnxEngine) -> None:
    """Skip a test that counts the engine's passes or positions: neighbours add theirs."""
    if engine in BUSY:
        pytest.skip("counts engine-wide passes and positions; the background neighbours add theirs")


@contextlib.contextmanager
def failing_once(target: Any, name: str, at_call: int, exc: BaseException) -> Iterator[None]:
    """Inside the block, ``target.name`` raises ``exc`` on its ``at_call``-th call (and
    works otherwise); the real one is back after it."""
    real = getattr(target, name)
    calls = 0

    def flaky(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == at_call:
            raise exc
        return real(*args)

    setattr(target, name, flaky)
    try:
        yield
    finally:
        setattr(target, name, real)
