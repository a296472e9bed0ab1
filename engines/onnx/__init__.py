"""The ONNX Runtime engine (``engine.name = "onnx"``) and its demo model.

Importing this package does not import onnxruntime; the engine module does,
when the engine is loaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sessiontape.engines.onnx.engine import OnnxEngine

__all__ = ["OnnxEngine"]


def __getattr__(name: str) -> Any:
    if name == "OnnxEngine":
        from sessiontape.engines.onnx.engine import OnnxEngine

        return OnnxEngine
    raise AttributeError(name)
