"""The sampling a model recommends, where a request names none.

A chat model is tuned for some sampling: SmolLM2-135M-Instruct's card samples at
temperature 0.2 and top_p 0.9, and at the OpenAI API's default (temperature 1) its
answers wander off. Servers of such models (vLLM's ``--generation-config auto``, the
default) take what the model's files recommend for every field a request leaves
unset; sessiontape does the same, from, in order of precedence:

1. the engine's options (``default_temperature``, ``default_top_p``, ``default_top_k``,
   ``default_repetition_penalty``, ``default_min_p``, ``default_penalty_last_n``);
2. the registry entry the model was named by (:mod:`.registry`);
3. the source's own files, recorded in the imported folder's ``config.json`` under
   ``"sampling"``: a Hugging Face folder's ``generation_config.json`` (``temperature``,
   ``top_p``, ``top_k``, ``repetition_penalty``, ``min_p``; ``do_sample`` is not read,
   as vLLM does not), a GGUF's ``general.sampling.temp`` / ``.top_p`` / ``.top_k`` /
   ``.penalty_repeat`` / ``.min_p`` / ``.penalty_last_n``.

A value a request names always wins, and ``generation.started`` records the values
used, so a replay or an audit never depends on the recommendation.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sessiontape.core.engine.interface import ModelSampling
from sessiontape.core.errors import UnsupportedModel
from sessiontape.core.settings_framework import option

#: the highest temperature and top_k a model or an operator may recommend
MAX_TEMPERATURE = 100.0
MAX_TOP_K = 2**31 - 1

#: a GGUF's keys for the fields (llama.cpp's ``general.sampling.*``)
GGUF_KEYS = {
    "temperature": "general.sampling.temp",
    "top_p": "general.sampling.top_p",
    "top_k": "general.sampling.top_k",
    "repetition_penalty": "general.sampling.penalty_repeat",
    "min_p": "general.sampling.min_p",
    "penalty_last_n": "general.sampling.penalty_last_n",
}
#: the highest repetition penalty a model or an operator may recommend
MAX_REPETITION_PENALTY = 10.0


def checked_sampling(values: Mapping[str, Any], where: str) -> ModelSampling:
    """``values`` (``temperature``, ``top_p``, ``top_k``, ``repetition_penalty``,
    ``min_p``, ``penalty_last_n``; others ignored, each optional) as a
    :class:`ModelSampling`; UnsupportedModel naming ``where`` for a value out of range.
    A top_k of 0 means no top-k filter, as in a request."""
    temperature, top_p, top_k = (values.get(k) for k in ("temperature", "top_p", "top_k"))
    penalty, min_p, last_n = (
        values.get(k) for k in ("repetition_penalty", "min_p", "penalty_last_n")
    )
    if temperature is not None and not (
        _number(temperature) and 0 <= temperature <= MAX_TEMPERATURE
    ):
        raise UnsupportedModel(
            f"{where}: temperature must be a number in [0, {MAX_TEMPERATURE:g}], "
            f"got {temperature!r}"
        )
    if top_p is not None and not (_number(top_p) and 0 < top_p <= 1):
        raise UnsupportedModel(f"{where}: top_p must be a number in (0, 1], got {top_p!r}")
    for name, value, top in (("top_k", top_k, MAX_TOP_K), ("penalty_last_n", last_n, MAX_TOP_K)):
        low = -1 if name == "penalty_last_n" else 0
        if value is not None and not (
            _number(value) and float(value).is_integer() and low <= value <= top
        ):
            raise UnsupportedModel(
                f"{where}: {name} must be an integer in [{low}, 2**31), got {value!r}"
            )
    if penalty is not None and not (_number(penalty) and 0 < penalty <= MAX_REPETITION_PENALTY):
        raise UnsupportedModel(
            f"{where}: repetition_penalty must be a number in (0, {MAX_REPETITION_PENALTY:g}], "
            f"got {penalty!r}"
        )
    if min_p is not None and not (_number(min_p) and 0 <= min_p <= 1):
        raise UnsupportedModel(f"{where}: min_p must be a number in [0, 1], got {min_p!r}")
    return ModelSampling(
        temperature=None if temperature is None else float(temperature),
        top_p=None if top_p is None else float(top_p),
        top_k=None if top_k is None else int(top_k),
        repetition_penalty=None if penalty is None else float(penalty),
        min_p=None if min_p is None else float(min_p),
        penalty_last_n=None if last_n is None else int(last_n),
    )


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def gguf_sampling(meta: Mapping[str, Any], name: str) -> ModelSampling:
    """What a GGUF's metadata recommends (``general.sampling.*``)."""
    found = {field: meta[key] for field, key in GGUF_KEYS.items() if key in meta}
    return checked_sampling(found, f"{name}: GGUF general.sampling")


def hf_sampling(folder: Path) -> ModelSampling:
    """What a Hugging Face folder's ``generation_config.json`` recommends (nothing
    without one)."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return ModelSampling()
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UnsupportedModel(f"{path}: cannot read it: {exc}") from exc
    if not isinstance(cfg, dict):
        raise UnsupportedModel(f"{path} does not hold a JSON object")
    return checked_sampling(cfg, str(path))


@dataclass(frozen=True)
class SamplingOptions:
    """An engine's ``[engine.options]`` for the sampling of a request that names none
    (the first layer of :func:`layered`)."""

    default_temperature: float | None = option(
        None,
        "the temperature of a request that names none",
        ge=0,
        le=MAX_TEMPERATURE,
        shown="the model's recommendation (docs/models.md), else 1",
    )
    default_top_p: float | None = option(
        None,
        "the top_p of a request that names none",
        gt=0,
        le=1,
        shown="the model's recommendation, else 1",
    )
    default_top_k: int | None = option(
        None,
        "the top_k of a request that names none (0: no top-k filter)",
        ge=0,
        le=MAX_TOP_K,
        shown="the model's recommendation, else 0",
    )
    default_repetition_penalty: float | None = option(
        None,
        "the repetition_penalty of a request that names none (1: none)",
        gt=0,
        le=MAX_REPETITION_PENALTY,
        shown="the model's recommendation, else 1.1 on the OpenAI chat routes and 1 elsewhere",
    )
    default_min_p: float | None = option(
        None,
        "the min_p of a request that names none (0: no min-p filter)",
        ge=0,
        le=1,
        shown="the model's recommendation, else 0",
    )
    default_penalty_last_n: int | None = option(
        None,
        "how many of the last history tokens the penalties look at (-1: all)",
        ge=-1,
        le=MAX_TOP_K,
        shown="the model's recommendation, else 64",
    )

    def chosen(self) -> ModelSampling:
        return ModelSampling(
            self.default_temperature,
            self.default_top_p,
            self.default_top_k,
            self.default_repetition_penalty,
            self.default_min_p,
            self.default_penalty_last_n,
        )


def layered(*layers: ModelSampling) -> ModelSampling:
    """The fields of ``layers``, the first that says something winning for each."""
    out: dict[str, Any] = {}
    for layer in reversed(layers):
        out.update(layer.to_json())
    return ModelSampling(**out)
