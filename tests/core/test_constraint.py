"""Constrained decoding (core/constraint.py, engines/constrained.py) on the reference
engine: outputs match their schema, regex or grammar; the constraint is recorded with the
generation; the same ids on re-execution and after a fork inside the constrained text."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from sessiontape.core.audit import audit_session
from sessiontape.core.bodies import GenerationFinished, GenerationStarted, body
from sessiontape.core.constraint import Constraint
from sessiontape.core.engine.interface import SamplingParams
from sessiontape.core.errors import InvalidConstraint
from sessiontape.core.events import Event, T
from sessiontape.core.generation.request import GenerateRequest
from sessiontape.core.runtime import Runtime
from sessiontape.engines.reference import ReferenceEngine
from tests.helpers.config import make_config
from tests.helpers.schemas import STRICT_SCHEMAS

PROMPT = list(b"Answer in JSON: ")


async def _generate(
    rt: Runtime, sid: str, params: SamplingParams
) -> tuple[list[int], GenerationStarted, GenerationFinished]:
    evs: list[Event] = [e async for e in rt.generate(sid, GenerateRequest(params))]
    started = next(body(e, GenerationStarted) for e in evs if e.type == T.GENERATION_STARTED)
    finished = next(body(e, GenerationFinished) for e in evs if e.type == T.GENERATION_FINISHED)
    ids = [int(e.body["token"]) for e in evs if e.type == T.GENERATION_TOKEN]
    return ids, started, finished


def _text(ids: list[int]) -> str:
    return bytes(i for i in ids if i < 256).decode("utf-8")


async def _session(rt: Runtime) -> str:
    sid = (await rt.open_session("test")).session_id
    await rt.append_tokens(sid, PROMPT)
    return sid


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "count": {"type": "integer"},
        "kind": {"type": "string", "enum": ["a", "bb", "ccc"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        "maybe": {"type": ["number", "null"]},
    },
    "required": ["name", "count", "kind", "tags", "maybe"],
    "additionalProperties": False,
}


async def test_a_schema_constrained_generation_validates_and_is_recorded(
    runtime: Runtime,
) -> None:
    sid = await _session(runtime)
    c = Constraint.json_schema(SCHEMA)
    ids, started, finished = await _generate(
        runtime, sid, SamplingParams(max_tokens=400, seed=7, constraint=c)
    )
    assert finished["finish_reason"] == "eos" and ids[-1] == 257
    value = json.loads(_text(ids))
    jsonschema.validate(value, SCHEMA)
    assert list(value) == list(SCHEMA["properties"])  # written in the schema's order
    recorded = started["params"]["constraint"]
    assert recorded == {"kind": "json_schema", "text": c.text, "sha256": c.sha256, "start": None}
    assert Constraint.from_json(recorded) == c
    report = await audit_session(runtime, sid, reexecute=True)
    assert report.reexecuted and report.generations == 1 and report.divergences == []


async def test_unconstrained_generations_record_no_constraint(runtime: Runtime) -> None:
    sid = await _session(runtime)
    _, started, finished = await _generate(runtime, sid, SamplingParams(max_tokens=3, seed=1))
    assert "constraint" not in started["params"]
    assert "constraint_incomplete" not in finished


async def test_regex_and_grammar_and_json_object(runtime: Runtime) -> None:
    sid = await _session(runtime)
    ids, _, _ = await _generate(
        runtime,
        sid,
        SamplingParams(max_tokens=40, seed=3, constraint=Constraint.regex(r"[0-9]{3}-[a-z]{2}")),
    )
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", _text(ids))
    lark = 'start: "yes" | "no" | "maybe " NUM\nNUM: /[1-9][0-9]?/\n'
    ids, _, _ = await _generate(
        runtime, sid, SamplingParams(max_tokens=40, seed=5, constraint=Constraint.lark(lark))
    )
    assert re.fullmatch(r"yes|no|maybe [1-9][0-9]?", _text(ids))
    ids, _, _ = await _generate(
        runtime,
        sid,
        SamplingParams(max_tokens=300, seed=9, constraint=Constraint.json_object()),
    )
    if ids[-1] == 257:
        assert isinstance(json.loads(_text(ids)), dict)


async def test_max_tokens_before_the_grammar_completes_says_length(runtime: Runtime) -> None:
    sid = await _session(runtime)
    ids, _, finished = await _generate(
        runtime,
        sid,
        SamplingParams(max_tokens=4, seed=2, constraint=Constraint.json_schema(SCHEMA)),
    )
    assert len(ids) == 4 and finished["finish_reason"] == "length"
    assert finished["constraint_incomplete"] is True
    with pytest.raises(ValueError):
        json.loads(_text(ids))


@pytest.mark.parametrize(
    "wire",
    [
        {"regex": "("},
        {"grammar": "start: undefined_rule\n"},
        {"json_schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
        {"json_schema": {}, "regex": "a"},
        {"json_object": False},
        {"regex": "a", "start": -1},
    ],
)
def test_bad_constraints_are_typed_errors(wire: dict[str, Any]) -> None:
    with pytest.raises(InvalidConstraint):
        Constraint.from_wire(wire)


async def test_a_history_that_does_not_match_the_constraint_is_refused(runtime: Runtime) -> None:
    sid = await _session(runtime)
    c = Constraint("regex", "[0-9]+", start=0)  # the prompt is not digits
    with pytest.raises(InvalidConstraint):
        await _generate(runtime, sid, SamplingParams(max_tokens=3, seed=1, constraint=c))


@seed(51)
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(schema=STRICT_SCHEMAS, gen_seed=st.integers(0, 2**32), cut=st.floats(0.05, 0.95))
def test_random_strict_schemas_validate_replay_and_fork_bit_exact(
    tmp_path_factory: pytest.TempPathFactory, schema: dict[str, Any], gen_seed: int, cut: float
) -> None:
    import asyncio

    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('db')}/log.db"

    async def check() -> None:
        engine = ReferenceEngine(eos_bias=-1000.0)
        rt = await Runtime.create(make_config(url), engine=engine)
        try:
            sid = await _session(rt)
            c = Constraint.json_schema(schema)
            params = SamplingParams(max_tokens=600, seed=gen_seed, temperature=0.8, constraint=c)
            ids, started, finished = await _generate(rt, sid, params)
            assert finished["finish_reason"] == "eos", (schema, _text(ids))
            jsonschema.validate(json.loads(_text(ids)), schema)
            report = await audit_session(rt, sid, reexecute=True)
            assert report.divergences == [] and report.generations == 1
            # a fork at a token inside the JSON continues it to the same ids
            prompt = int(started["prompt_length"])
            at = prompt + max(1, int(cut * (len(ids) - 1)))
            child = (await rt.fork(sid, at_position=at)).session_id
            rest = SamplingParams(
                max_tokens=600 - (at - prompt),
                seed=gen_seed,
                temperature=0.8,
                constraint=Constraint(c.kind, c.text, start=prompt),
            )
            again, _, _ = await _generate(rt, child, rest)
            assert again == ids[at - prompt :]
        finally:
            await rt.aclose()

    asyncio.run(check())


def test_unbounded_integers_are_generated_within_the_safe_range() -> None:
    from sessiontape.core.constraint import SAFE_INTEGER, bounded_integers

    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {"type": ["integer", "null"], "minimum": 3},
            "c": {"const": {"type": "integer"}},
        },
    }
    bounded = bounded_integers(schema)
    props = bounded["properties"]
    assert props["a"] == {"type": "integer", "minimum": -SAFE_INTEGER, "maximum": SAFE_INTEGER}
    assert props["b"]["minimum"] == 3 and props["b"]["maximum"] == SAFE_INTEGER
    assert props["c"] == {"const": {"type": "integer"}}  # data, not a schema
    assert schema["properties"]["a"] == {"type": "integer"}  # the recorded schema is as given


async def test_an_unbounded_integer_ends(runtime: Runtime) -> None:
    sid = await _session(runtime)
    # the reference engine's digits: without a bound, a long run of them could go on
    c = Constraint.json_schema({"type": "integer"})
    for s in range(5):
        ids, _, finished = await _generate(
            runtime, sid, SamplingParams(max_tokens=40, seed=s, constraint=c)
        )
        assert finished["finish_reason"] == "eos"
        assert abs(int(_text(ids))) <= 2**53 - 1
