"""The HTTP routes leave the sampling a request does not name to the served model's
recommendation (engines/models/sampling_defaults.py): the native generate and the OpenAI routes,
driven by the official ``openai`` package; the model card says what a request gets."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from sessiontape.core.events import T
from sessiontape.core.runtime import Runtime
from sessiontape.engines.reference import ReferenceEngine
from tests.helpers.http import Served, serving

MODEL = "reference-bigram-v1"
RECOMMENDED = {"temperature": 0.25, "top_p": 0.5, "top_k": 7}
#: the wires' own defaults, named in a request
NAMED = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}


@pytest.fixture
async def live(sqlite_url: str, port: int) -> AsyncIterator[Served]:
    engine = ReferenceEngine(
        eos_bias=-100.0,
        default_temperature=RECOMMENDED["temperature"],
        default_top_p=RECOMMENDED["top_p"],
        default_top_k=RECOMMENDED["top_k"],
    )
    async with serving(sqlite_url, port, engine=engine) as s:
        yield s


async def started(rt: Runtime) -> list[dict[str, Any]]:
    """Every generation's recorded sampling, in the order they began."""
    out = []
    for row in await rt.log.list_sessions(limit=1000):
        for e in await rt.log.read(row.id):
            if e.type == T.GENERATION_STARTED:
                out.append((e.position, {k: e.body["params"][k] for k in NAMED}))
    return [params for _, params in sorted(out, key=lambda x: x[0])]


async def test_generate_takes_the_models_sampling_for_fields_left_unset_or_null(
    live: Served,
) -> None:
    async with httpx.AsyncClient(base_url=live.url) as c:
        sid = (await c.post("/v1/sessions", json={})).json()["id"]
        for fields in ({}, NAMED, {"temperature": None, "top_p": None, "top_k": 3}):
            r = await c.post(
                f"/v1/sessions/{sid}/generate",
                json={"text": "hi", "max_tokens": 2, "stream": False, **fields},
            )
            assert r.status_code == 200, r.text
    assert await started(live.runtime) == [RECOMMENDED, NAMED, {**RECOMMENDED, "top_k": 3}]


async def test_openai_routes_take_the_models_sampling_and_echo_what_they_used(
    live: Served,
) -> None:
    async with openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0) as c:
        card = await c.models.retrieve(MODEL)
        msg = [{"role": "user", "content": "hi"}]
        await c.chat.completions.create(model=MODEL, messages=msg, max_tokens=2)  # type: ignore[arg-type]
        await c.chat.completions.create(
            model=MODEL,
            messages=msg,  # type: ignore[arg-type]
            max_tokens=2,
            temperature=1.0,
            top_p=1.0,
        )
        left = await c.responses.create(model=MODEL, input="hi", max_output_tokens=16)
        named = await c.responses.create(
            model=MODEL, input="hi", max_output_tokens=16, temperature=0.5
        )
    assert (card.model_extra or {})["sampling"] == RECOMMENDED
    # OpenAI's API names no top_k: the model's applies to every request
    assert await started(live.runtime) == [
        RECOMMENDED,
        {**NAMED, "top_k": 7},
        RECOMMENDED,
        {**RECOMMENDED, "temperature": 0.5},
    ]
    assert (left.temperature, left.top_p) == (0.25, 0.5)
    assert (named.temperature, named.top_p) == (0.5, 0.5)
