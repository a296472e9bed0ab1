"""The sampling a model recommends (engines/models/sampling_defaults.py): read from a GGUF's
``general.sampling.*`` and a Hugging Face folder's ``generation_config.json``, recorded by
the import, layered under the registry entry and the engine's options, and served as
:attr:`EngineInfo.sampling`; values out of range refused by name."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessiontape.core.engine.interface import ModelSampling, SamplingParams, left_to_model
from sessiontape.core.errors import ConfigError, UnsupportedModel
from sessiontape.engines.models.registry import REGISTRY
from sessiontape.engines.models.sampling_defaults import checked_sampling, hf_sampling, layered
from sessiontape.engines.models.sources import GgufSource
from sessiontape.engines.onnx.importer import import_model
from sessiontape.engines.onnx.loading import served_sampling
from sessiontape.engines.onnx.options import OnnxOptions
from tests.helpers import checkpoints as ck
from tests.helpers.checkpoints import LLAMA


def test_params_take_the_models_values_only_for_fields_left_to_it() -> None:
    model = ModelSampling(temperature=0.2, top_p=0.9)
    left = SamplingParams(temperature=1.0, top_p=0.5, from_model=left_to_model(temperature=None))
    got = left.for_model(model)
    assert (got.temperature, got.top_p, got.top_k, got.from_model) == (0.2, 0.5, 0, frozenset())
    # a field the model says nothing of keeps its value
    assert SamplingParams(from_model=frozenset({"top_k"})).for_model(model).top_k == 0
    named = SamplingParams(temperature=1.0)
    assert named.for_model(model) is named
    with pytest.raises(ValueError, match="max_tokens"):
        left_to_model(max_tokens=None)


def test_layers_the_first_that_says_something_wins() -> None:
    got = layered(
        ModelSampling(top_k=3), ModelSampling(temperature=0.2, top_k=9), ModelSampling(top_p=0.7)
    )
    assert got == ModelSampling(temperature=0.2, top_p=0.7, top_k=3)


BAD = [
    {"temperature": -0.1},
    {"temperature": math.nan},
    {"temperature": math.inf},
    {"temperature": 101},
    {"temperature": "0.2"},
    {"temperature": True},
    {"top_p": 0},
    {"top_p": 1.5},
    {"top_p": None, "top_k": -1},
    {"top_k": 2.5},
    {"top_k": 2**31},
    {"top_k": [1]},
]


@pytest.mark.parametrize("values", BAD, ids=[json.dumps(v, default=str) for v in BAD])
def test_values_out_of_range_are_refused_by_name(values: dict[str, Any]) -> None:
    field = next(k for k, v in values.items() if v is not None)
    with pytest.raises(UnsupportedModel, match=f"x.gguf: {field} must be"):
        checked_sampling(values, "x.gguf")


JSONISH = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.lists(st.integers(), max_size=2),
)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.dictionaries(st.sampled_from(["temperature", "top_p", "top_k", "min_p"]), JSONISH))
def test_any_values_give_a_valid_recommendation_or_unsupported_model(
    values: dict[str, Any],
) -> None:
    try:
        got = checked_sampling(values, "here")
    except UnsupportedModel:
        return
    # whatever passes is something a request could have named itself
    SamplingParams(
        temperature=1.0 if got.temperature is None else got.temperature,
        top_p=1.0 if got.top_p is None else got.top_p,
        top_k=0 if got.top_k is None else got.top_k,
    ).check()


def test_gguf_metadata_is_recorded_by_the_import(tmp_path: Path) -> None:
    general = {"general.sampling.temp": 0.5, "general.sampling.top_k": 40}
    src = ck.write_gguf(tmp_path / "t.gguf", LLAMA, ck.random_weights(LLAMA), general=general)
    assert GgufSource(src.path).sampling == ModelSampling(temperature=0.5, top_k=40)
    out = import_model(src.path, tmp_path / "out", concepts=False).folder
    assert json.loads((out / "config.json").read_text())["sampling"] == {
        "temperature": 0.5,
        "top_k": 40,
    }
    # the engine's options win over the model, field by field
    o = OnnxOptions(model_dir=out, default_top_k=0)
    assert served_sampling(out, o) == ModelSampling(temperature=0.5, top_k=0)


def test_a_gguf_with_a_bad_recommendation_is_refused(tmp_path: Path) -> None:
    general = {"general.sampling.top_p": 2.0}
    src = ck.write_gguf(tmp_path / "t.gguf", LLAMA, ck.random_weights(LLAMA), general=general)
    with pytest.raises(UnsupportedModel, match=r"general\.sampling: top_p must be"):
        import_model(src.path, tmp_path / "out", concepts=False)
    assert not (tmp_path / "out").exists()


def test_hf_generation_config(tmp_path: Path) -> None:
    folder = ck.write_hf(tmp_path / "hf", LLAMA, ck.random_weights(LLAMA))
    assert hf_sampling(folder) == ModelSampling()
    gen = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "max_new_tokens": 9}
    (folder / "generation_config.json").write_text(json.dumps(gen))
    assert hf_sampling(folder) == ModelSampling(temperature=0.6, top_p=0.95)
    for bad in ("{", "[1]", '{"temperature": -1}'):
        (folder / "generation_config.json").write_text(bad)
        with pytest.raises(UnsupportedModel, match=r"generation_config\.json"):
            hf_sampling(folder)


def test_a_folder_with_a_bad_recorded_recommendation_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"sampling": {"top_p": 0}}))
    with pytest.raises(UnsupportedModel, match="sampling: top_p must be"):
        served_sampling(tmp_path, OnnxOptions(model_dir=tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"sampling": [0.2]}))
    with pytest.raises(ConfigError, match="sampling is not a JSON object"):
        served_sampling(tmp_path, OnnxOptions(model_dir=tmp_path))


def test_the_registry_model_recommends_its_cards_sampling(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"sampling": {"top_k": 5}}))
    entry = REGISTRY["smollm2-135m-instruct"].sampling
    assert entry == ModelSampling(temperature=0.2, top_p=0.9)
    o = OnnxOptions(model="smollm2-135m-instruct")
    assert served_sampling(tmp_path, o) == ModelSampling(temperature=0.2, top_p=0.9, top_k=5)
    # a folder named as it is: only its own recommendation
    assert served_sampling(tmp_path, OnnxOptions(model_dir=tmp_path)) == ModelSampling(top_k=5)


BAD_OPTIONS = [
    ("default_temperature", math.nan),
    ("default_temperature", math.inf),
    ("default_temperature", -1),
    ("default_temperature", 101),
    ("default_temperature", "0.2"),
    ("default_temperature", True),
    ("default_top_p", 0),
    ("default_top_p", 1.5),
    ("default_top_p", [0.9]),
    ("default_top_k", -1),
    ("default_top_k", 2.5),
    ("default_top_k", 2**70),
    ("default_top_k", "7"),
]


@pytest.mark.parametrize(("name", "value"), BAD_OPTIONS, ids=[f"{n}={v!r}" for n, v in BAD_OPTIONS])
def test_bad_default_sampling_options_are_refused_by_name(name: str, value: Any) -> None:
    """Both engines take the options through one class; a bad value is a ConfigError
    naming it, before any model is opened."""
    from sessiontape.engines.onnx.engine import OnnxEngine
    from sessiontape.engines.reference import ReferenceEngine

    with pytest.raises(ConfigError, match=name):
        ReferenceEngine(**{name: value})
    with pytest.raises(ConfigError, match=name):
        OnnxEngine(model_dir="/nonexistent", **{name: value})
