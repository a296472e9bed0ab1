"""D4 message rules (pure): validation, exact integers, cost planning, result bodies."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sessiontape.core.errors import ConfigError, InvalidParameters
from sessiontape.transports.nostr import d4
from sessiontape.transports.nostr.settings import Settings
from tests.helpers.nostr import call_body

# the DDIP's wire sample, verbatim apart from the triple quotes
SAMPLE_CONTENT = (
    '{"max_iteration_cost": 1000, "max_total_cost": 1000000, "results": 1, "version": "0.1.0", '
    '"args": {"prompt": "<s>[INST] What is the capital of France? [/INST]", '
    '"model": "mistral-7b-instruct-v0.1.Q4_K_M.gguf", "temperature": 0.0, "top_p": 0.95, '
    '"top_k": 40, "min_p": 0.05, "typical_p": 1.0, "stop": [], "seed": 3283645831608526411, '
    '"response_format": null, "max_tokens": null, "presence_penalty": 0, "frequency_penalty": 0, '
    '"repeat_penalty": 1.0, "tfs_z": 1.0}}'
)


def test_sample_call_parses_with_exact_seed() -> None:
    call = d4.parse_call(d4.parse_object(SAMPLE_CONTENT))
    assert call.max_iteration_cost == 1000 and call.max_total_cost == 1_000_000
    assert call.args.seed == 3283645831608526411  # above 2**53: a float would round it
    assert call.args.max_tokens is None and call.args.top_k == 40 and call.args.stop == ()
    assert d4.classify(d4.parse_object(SAMPLE_CONTENT)) == d4.CALL


def test_seed_beyond_2_53_survives_parsing() -> None:
    seed = 2**53 + 1
    assert (
        d4.parse_call(d4.parse_object(json.dumps(call_body(args={"seed": seed})))).args.seed == seed
    )


@pytest.mark.parametrize(
    "change",
    [
        {"max_iteration_cost": 0},
        {"max_iteration_cost": -1},
        {"max_iteration_cost": 1.5},
        {"max_iteration_cost": True},
        {"max_total_cost": "100"},
        {"max_total_cost": None},
        {"results": 0},
        {"version": "0.2.0"},
        {"version": 1},
        {"args": [1]},
        {"args": None},
        {"args": {"prompt": 5}},
        {"args": {"temperature": -1}},
        {"args": {"top_p": 0}},
        {"args": {"seed": 2**64}},
        {"args": {"seed": -1}},
        {"args": {"max_tokens": 0}},
        {"args": {"stop": [1]}},
        {"args": {"top_k": 1.5}},
    ],
)
def test_invalid_calls_raise(change: dict[str, Any]) -> None:
    body = call_body()
    if "args" in change and isinstance(change["args"], dict):
        body["args"].update(change["args"])
    else:
        body.update(change)
    with pytest.raises(InvalidParameters):
        d4.parse_call(body)


def test_unknown_args_ignored_and_missing_optional_fields_default() -> None:
    body = {
        "max_iteration_cost": 1,
        "max_total_cost": 1,
        "version": "0.1.7",
        "args": {"prompt": "x", "mirostat": 2},
    }
    call = d4.parse_call(body)
    assert call.results == 1 and call.args.temperature == 1.0 and call.args.seed is None


def test_content_must_be_an_object() -> None:
    for bad in ("", "[1]", "{", "null"):
        with pytest.raises(InvalidParameters):
            d4.parse_object(bad)


def test_cost_planning_never_exceeds_the_caps() -> None:
    assert d4.plan_tokens(1000, 5500, 11) == (5, True)
    assert d4.plan_tokens(1000, 1_000_000, 11) == (11, False)
    assert d4.plan_tokens(0, 1, 50) == (50, False)
    body = call_body(max_iteration_cost=999)
    assert d4.needs_negotiation(1000, d4.parse_call(body))
    assert d4.needs_negotiation(1000, d4.parse_call(call_body(max_total_cost=999)))
    assert not d4.needs_negotiation(1000, d4.parse_call(call_body()))


def test_feedback_and_classification() -> None:
    assert d4.parse_feedback({"score": 9, "version": "0.1.0"}).score == 9
    for bad in (
        {"score": 10, "version": "0.1.0"},
        {"score": "5", "version": "0.1.0"},
        {"score": 5},
    ):
        with pytest.raises(InvalidParameters):
            d4.parse_feedback(bad)
    assert d4.classify({"score": 3}) == d4.FEEDBACK
    assert d4.classify({"result": None, "iteration_cost": 1, "total_cost": 1}) == d4.RESULT


def test_result_content_serializes_result_and_err_as_json_strings() -> None:
    c = json.loads(
        d4.result_content(
            result={"a": 1},
            iteration_cost=1,
            total_cost=2,
            more_results=True,
            partial=True,
            err={"code": "x", "message": "y"},
        )
    )
    assert json.loads(c["result"]) == {"a": 1} and json.loads(c["err"]) == {
        "code": "x",
        "message": "y",
    }
    assert c["partial"] is True and c["version"] == "0.1.0"


def test_e_refs_keep_order_and_skip_malformed() -> None:
    a, b = "a" * 64, "B" * 64
    assert d4.e_refs([["e", a], ["p", a], ["e", "short"], ["e", b], ["e", a]]) == [a, b.lower()]


@pytest.mark.parametrize(
    "bad", [{"index_size": 0}, {"republish_every_s": 0}, {"index_size": "many"}]
)
def test_settings_reject_bad_memory_options(tmp_path: Path, bad: dict[str, object]) -> None:
    key = tmp_path / "k"
    key.write_text("11" * 32)
    with pytest.raises(ConfigError):
        Settings.from_options({"relays": ["ws://127.0.0.1:1"], "key_file": str(key), **bad})
    assert (
        Settings.from_options({"relays": ["ws://127.0.0.1:1"], "key_file": str(key)}).index_size
        == 10_000
    )


def test_sampling_a_call_leaves_out_or_nulls_is_the_models() -> None:
    args = d4.parse_args({"temperature": 0.3, "top_k": None})
    # the penalties' window is never a call's to set
    window = {"penalty_last_n"}
    assert args.from_model == {"top_p", "top_k", "repetition_penalty", "min_p"} | window
    every = {"temperature": 1, "top_p": 1, "top_k": 0, "repeat_penalty": 1, "min_p": 0}
    assert d4.parse_args(every).from_model == window


def test_penalties_and_min_p_of_a_call() -> None:
    args = d4.parse_args(
        {"repeat_penalty": 1.3, "frequency_penalty": -0.5, "presence_penalty": 2, "min_p": 0.05}
    )
    params = args.sampling(12)
    assert (params.repetition_penalty, params.frequency_penalty) == (1.3, -0.5)
    assert (params.presence_penalty, params.min_p, params.max_tokens) == (2.0, 0.05, 12)
    params.check()


@pytest.mark.parametrize(
    "bad",
    [
        {"repeat_penalty": 0},
        {"repeat_penalty": -1.1},
        {"repeat_penalty": float("nan")},
        {"repeat_penalty": float("inf")},
        {"frequency_penalty": 2.5},
        {"presence_penalty": -2.01},
        {"presence_penalty": float("nan")},
        {"min_p": 1.5},
        {"min_p": -0.1},
        {"min_p": "0.1"},
    ],
)
def test_penalties_out_of_range_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(InvalidParameters, match=next(iter(bad))):
        d4.parse_args(bad)
