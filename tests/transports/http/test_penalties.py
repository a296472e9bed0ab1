"""Penalties and min_p on the HTTP routes: the OpenAI routes (driven by the official
``openai`` package) and the native generate take them, record them in
``generation.started``, refuse them out of range with nothing stored, and leave them
to the model's recommendation when unset (1.1 on the chat routes when it has none)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from sessiontape.core.events import T
from sessiontape.core.runtime import Runtime
from sessiontape.engines.reference import ReferenceEngine
from sessiontape.transports.http.openai.bodies import CHAT_REPETITION_PENALTY
from tests.helpers.http import Served, serving

MODEL = "reference-bigram-v1"
PENALTIES = ("repetition_penalty", "frequency_penalty", "presence_penalty", "min_p")
MSG: Any = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def live(sqlite_url: str, port: int) -> AsyncIterator[Served]:
    async with serving(sqlite_url, port, engine=ReferenceEngine(eos_bias=-100.0)) as s:
        yield s


@pytest.fixture
async def recommending(sqlite_url: str, port: int) -> AsyncIterator[Served]:
    engine = ReferenceEngine(eos_bias=-100.0, default_repetition_penalty=1.3, default_min_p=0.02)
    async with serving(sqlite_url, port, engine=engine) as s:
        yield s


async def recorded(rt: Runtime) -> list[dict[str, Any]]:
    """Every generation's recorded penalties (the fields recorded), in the order they began."""
    out = []
    for row in await rt.log.list_sessions(limit=1000):
        for e in await rt.log.read(row.id):
            if e.type == T.GENERATION_STARTED:
                params = e.body["params"]
                kept = {k: params[k] for k in (*PENALTIES, "penalty_last_n") if k in params}
                out.append((e.position, kept))
    return [params for _, params in sorted(out, key=lambda x: x[0])]


async def event_count(rt: Runtime) -> int:
    return sum([len(await rt.log.read(row.id)) for row in await rt.log.list_sessions(limit=1000)])


async def test_openai_routes_take_and_record_the_penalties(live: Served) -> None:
    async with openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0) as c:
        await c.chat.completions.create(
            model=MODEL,
            messages=MSG,
            max_tokens=3,
            frequency_penalty=0.5,
            presence_penalty=-0.25,
            extra_body={"repetition_penalty": 1.25, "min_p": 0.1},
        )
        await c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=3)
        await c.responses.create(
            model=MODEL,
            input="hi",
            max_output_tokens=16,
            extra_body={"frequency_penalty": 1.5, "repetition_penalty": 1.0},
        )
    assert await recorded(live.runtime) == [
        {
            "repetition_penalty": 1.25,
            "frequency_penalty": 0.5,
            "presence_penalty": -0.25,
            "penalty_last_n": 64,
            "min_p": 0.1,
        },
        {
            "repetition_penalty": CHAT_REPETITION_PENALTY,
            "frequency_penalty": 0.0,
            "presence_penalty": 0.0,
            "penalty_last_n": 64,
        },
        {
            "repetition_penalty": 1.0,
            "frequency_penalty": 1.5,
            "presence_penalty": 0.0,
            "penalty_last_n": 64,
        },
    ]


async def test_the_models_recommendation_wins_over_the_chat_default(recommending: Served) -> None:
    async with openai.AsyncOpenAI(
        base_url=recommending.url + "/v1", api_key="x", max_retries=0
    ) as c:
        await c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2)
    async with httpx.AsyncClient(base_url=recommending.url) as h:
        sid = (await h.post("/v1/sessions", json={})).json()["id"]
        r = await h.post(
            f"/v1/sessions/{sid}/generate", json={"text": "hi", "max_tokens": 2, "stream": False}
        )
        assert r.status_code == 200, r.text
    chat, native = await recorded(recommending.runtime)
    assert chat["repetition_penalty"] == native["repetition_penalty"] == 1.3
    assert chat["min_p"] == native["min_p"] == 0.02


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("frequency_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("presence_penalty", 3),
        ("presence_penalty", "0.5"),
        ("repetition_penalty", 0),
        ("repetition_penalty", -1.2),
        ("min_p", 1.5),
        ("min_p", -0.1),
    ],
)
async def test_openai_routes_refuse_penalties_out_of_range(
    live: Served, field: str, value: object
) -> None:
    async with openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0) as c:
        await c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2)
        before = await event_count(live.runtime)
        with pytest.raises(openai.BadRequestError) as chat:
            await c.chat.completions.create(
                model=MODEL, messages=MSG, max_tokens=2, extra_body={field: value}
            )
        with pytest.raises(openai.BadRequestError) as responses:
            await c.responses.create(model=MODEL, input="hi", extra_body={field: value})
    assert chat.value.param == responses.value.param == field
    assert await event_count(live.runtime) == before


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/responses"])
async def test_a_nan_penalty_is_refused(live: Served, route: str) -> None:
    body = json.dumps({"model": MODEL, "input": "hi", "messages": MSG})[:-1] + ","
    async with httpx.AsyncClient(base_url=live.url) as h:
        for field in ("frequency_penalty", "min_p", "repetition_penalty"):
            r = await h.post(route, content=f'{body} "{field}": NaN}}'.encode())
            assert r.status_code == 400, r.text
    assert await event_count(live.runtime) == 0


async def test_native_generate_takes_records_and_refuses_the_penalties(live: Served) -> None:
    async with httpx.AsyncClient(base_url=live.url) as h:
        sid = (await h.post("/v1/sessions", json={})).json()["id"]
        named = {
            "repetition_penalty": 1.2,
            "frequency_penalty": -1.0,
            "presence_penalty": 2.0,
            "min_p": 0.3,
            "penalty_last_n": -1,
        }
        r = await h.post(
            f"/v1/sessions/{sid}/generate",
            json={"text": "hi", "max_tokens": 2, "stream": False, **named},
        )
        assert r.status_code == 200, r.text
        # unset: no penalty (the native route has no chat default)
        r = await h.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 2, "stream": False})
        assert r.status_code == 200, r.text
        before = await event_count(live.runtime)
        for field, value in (
            ("repetition_penalty", 0),
            ("frequency_penalty", 2.5),
            ("presence_penalty", -9),
            ("min_p", 2),
            ("penalty_last_n", -2),
        ):
            r = await h.post(
                f"/v1/sessions/{sid}/generate",
                json={"text": "more", "max_tokens": 2, "stream": False, field: value},
            )
            assert r.status_code == 400 and field in r.text, r.text
        r = await h.post(
            f"/v1/sessions/{sid}/generate",
            content=b'{"text": "more", "max_tokens": 2, "min_p": NaN}',
        )
        assert r.status_code == 400, r.text
    assert await event_count(live.runtime) == before
    assert await recorded(live.runtime) == [named, {}]
