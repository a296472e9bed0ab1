"""Which model folder the ONNX engine serves, from its options.

``model`` (a registry name, a GGUF file or a Hugging Face folder, imported on
first use), ``model_dir`` (a folder as it is), ``size`` (a demo model), or with
none of them the registry's default model (docs/models.md).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from sessiontape.core.errors import ConfigError
from sessiontape.engines.models.registry import REGISTRY
from sessiontape.engines.onnx.demo import SIZES, ensure_demo

log = logging.getLogger("sessiontape.engines.onnx")


def model_folder(
    model: str | None, model_dir: str | Path | None, size: str | None, dtype: str, attention: str
) -> Path:
    """The folder the engine serves: ``model`` imported (cached), ``model_dir`` as it is, the
    demo of ``size``, or with none of them the default model (:func:`default_model`)."""
    from sessiontape.engines.onnx.importer import ensure_imported

    if model is not None:
        if model_dir is not None:
            raise ConfigError("give the onnx engine either model or model_dir, not both")
        return ensure_imported(str(model), str(dtype), str(attention))
    if model_dir is not None:
        return Path(model_dir)
    if size is None and (chosen := default_model()):
        return ensure_imported(chosen, str(dtype), str(attention))
    size = size or "tiny"
    if size not in SIZES:
        raise ConfigError(f"unknown demo model size {size!r}; choose one of {sorted(SIZES)}")
    return ensure_demo(size)


def registry_name(model: str | None, model_dir: str | Path | None, size: str | None) -> str | None:
    """The registry entry :func:`model_folder` serves for these options, if it serves one."""
    if model is None and model_dir is None and size is None:
        model = default_model()
    return model if model in REGISTRY else None


def default_model() -> str | None:
    """The registry model served when the config names none, if its package is installed.

    ``SESSIONTAPE_DEFAULT_MODEL`` names another registry model, or ``demo`` for the tiny
    demo model (the test suite's default).
    """
    from sessiontape.engines.models.registry import DEFAULT_MODEL, REGISTRY, installed

    name = os.environ.get("SESSIONTAPE_DEFAULT_MODEL") or DEFAULT_MODEL
    if name == "demo":
        return None
    if name not in REGISTRY:
        raise ConfigError(
            f"SESSIONTAPE_DEFAULT_MODEL={name!r} is not a registry model "
            f"({', '.join(sorted(REGISTRY))}) or 'demo'"
        )
    if installed(name):
        return name
    log.warning(
        "the default model's package (%s) is not installed; serving the tiny demo model "
        "(scripts/setup installs it)",
        REGISTRY[name].distribution,
    )
    return None
