"""The sessions list says what each session is about: the first user message of its first
OpenAI request (not the system prompt, not the template's markers), else its first input's
text; live in the list stream's patches and in a fresh snapshot alike."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from sessiontape.core.document.sessionlist import PREVIEW_CHARS, preview_text
from sessiontape.core.patch import apply_patch
from sessiontape.engines.reference import ReferenceEngine
from tests.helpers.http import Served, serving
from tests.helpers.sse_client import events

MODEL = "reference-bigram-v1"
QUESTION = "Which  river runs\nthrough Paris?"


@pytest.fixture
async def live(sqlite_url: str, port: int) -> AsyncIterator[Served]:
    async with serving(sqlite_url, port, engine=ReferenceEngine(eos_bias=-100.0)) as s:
        yield s


def test_a_preview_is_one_line_and_cut() -> None:
    assert preview_text("  a\n\tb  c ") == "a b c"
    long = preview_text("word " * 100)
    assert len(long) == PREVIEW_CHARS and long.endswith("…")


async def _snapshot(c: httpx.AsyncClient) -> dict[str, Any]:
    async with c.stream("GET", "/v1/sessions/events") as resp:
        snap = await anext(events(resp))
    assert snap.event == "snapshot"
    return dict(snap.json()["sessions"])


async def test_the_list_previews_chats_and_inputs(live: Served) -> None:
    async with httpx.AsyncClient(base_url=live.url, timeout=30) as h:
        async with h.stream("GET", "/v1/sessions/events") as resp:
            it = events(resp)
            doc = (await anext(it)).json()
            async with openai.AsyncOpenAI(
                base_url=live.url + "/v1", api_key="x", max_retries=0
            ) as c:
                r = await c.chat.completions.create(
                    model=MODEL,
                    messages=[
                        {"role": "system", "content": "You answer about rivers."},
                        {"role": "user", "content": QUESTION},
                    ],
                    max_tokens=3,
                )
            chat = (r.model_extra or {})["session_id"]
            empty = (await h.post("/v1/sessions", json={})).json()["id"]
            native = (await h.post("/v1/sessions", json={"label": "story"})).json()["id"]
            await h.post(f"/v1/sessions/{native}/append", json={"text": "Once upon a time"})
            while doc["sessions"].get(native, {}).get("preview") != "Once upon a time":
                ev = await anext(it)
                if ev.event == "patch":
                    doc = apply_patch(doc, ev.json())
        live_list = doc["sessions"]
        snapshot = await _snapshot(h)
    for sessions in (live_list, snapshot):
        assert sessions[chat]["preview"] == "Which river runs through Paris?"
        assert (sessions[native]["label"], sessions[native]["preview"]) == (
            "story",
            "Once upon a time",
        )
        assert sessions[empty]["preview"] == ""
