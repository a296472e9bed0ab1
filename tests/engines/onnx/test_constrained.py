"""Constrained decoding on the onnx engine (the demo model): the mask is part of sampling on
the single-session path and in the batch scheduler alike, so a constrained session decodes
the same bits alone, beside unconstrained neighbours, and unbatched."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema

from sessiontape.core.constraint import Constraint
from sessiontape.core.engine import OutputOptions, SamplingParams
from tests.engines.onnx.test_batch import SESSIONS, batching_engine, history, run

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"type": "string", "enum": ["alpha", "beta"]},
        "bits": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["id", "tag", "bits"],
    "additionalProperties": False,
}


async def test_a_constrained_session_decodes_the_same_bits_batched_and_alone(
    tiny_dir: Path,
) -> None:
    solo = batching_engine(tiny_dir, batch_slots=0)
    eos = solo.info.eos_token_ids
    params = SamplingParams(
        max_tokens=80,
        temperature=0.9,
        seed=5,
        stop_token_ids=eos,
        constraint=Constraint.json_schema(SCHEMA),
    )
    hist = history(3, 17)
    options = OutputOptions(logprob_top_k=3)
    ref = await run(solo, "c", hist, params, options)
    assert ref[-1].token_id in eos
    text = solo.detokenize([s.token_id for s in ref])
    jsonschema.validate(json.loads(text), SCHEMA)
    # top logprobs are those of the masked distribution: only ids the grammar allowed
    assert all(len(s.top_logprobs) <= 3 for s in ref)
    eng = batching_engine(tiny_dir, batch_slots=4)
    others = [run(eng, f"n{i}", history(s, m), p) for i, (s, m, p) in enumerate(SESSIONS[1:4])]
    got, *_ = await asyncio.gather(run(eng, "c", hist, params, options), *others)
    assert got == ref
    assert eng.scheduler_stats()["shared_passes"] > 0
    await solo.aclose()
    await eng.aclose()


async def test_a_regex_constraint_on_the_onnx_engine(tiny_dir: Path) -> None:
    eng = batching_engine(tiny_dir, batch_slots=0)
    params = SamplingParams(
        max_tokens=30,
        temperature=1.0,
        seed=9,
        stop_token_ids=eng.info.eos_token_ids,
        constraint=Constraint.regex(r"(yes|no), [a-z]{3}"),
    )
    steps = await run(eng, "r", history(4, 9), params)
    text = eng.detokenize([s.token_id for s in steps])
    assert text.startswith(("yes, ", "no, ")) and len(text.split(", ")[1]) == 3
    await eng.aclose()
