"""A chat session in the viewer: the OpenAI chat route drives a session, the page shows its
conversation as bubbles (live while the reply streams), the token view stays one click away, and
the scrubber shows the conversation as it was.

Headless Debian Chromium through playwright, a real uvicorn on loopback, the reference engine with
the demo models' role-marker template (which wraps every message in markers such as ``<|user|>``).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from tests.helpers.http import Served
from tests.helpers.viewer import ARTIFACTS, LAYOUT_CHECK, MARKS

pytestmark = MARKS

MODEL = "reference-bigram-v1"
QUESTION = "What is the capital of France?"
MARKERS = ("<|im_start|>", "<|im_end|>", "<|user|>", "<|assistant|>", "<|system|>")

BUBBLES = """() => [...document.querySelectorAll('#conversation .bubble')].map((b) =>
  [b.dataset.role, b.querySelector('.bubble-text').textContent, b.classList.contains('streaming')])"""


async def _stream_chat(
    c: httpx.AsyncClient, body: dict[str, Any], first: asyncio.Future[str]
) -> str:
    """A streamed chat completion: resolves ``first`` with the session's id, returns the reply."""
    text = ""
    async with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if not first.done():
                first.set_result(chunk["session_id"])
            for choice in chunk.get("choices", ()):
                text += choice["delta"].get("content") or ""
    return text


async def _bubbles(pg: Any) -> list[list[Any]]:
    return list(await pg.evaluate(BUBBLES))


async def test_a_chat_session_shows_its_conversation(server: Served, page: Any) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
        messages = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": QUESTION},
        ]
        first: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        streaming = asyncio.create_task(
            _stream_chat(
                c, {"model": MODEL, "messages": messages, "max_tokens": 60, "seed": 3}, first
            )
        )
        sid = await asyncio.wait_for(first, 20)

        # live: the question at once, the reply growing while it streams
        await page.goto(f"{server.url}/#/s/{sid}")
        await page.wait_for_selector("#mode:text('live')")
        await page.wait_for_selector(f"#conversation .bubble.user:has-text('{QUESTION}')")
        await page.wait_for_function(
            "document.querySelector('#conversation .bubble.assistant.streaming .bubble-text')"
            "?.textContent.length > 0"
        )
        early = (await _bubbles(page))[-1][1]
        reply = await streaming
        assert len(reply) > len(early) and reply.startswith(early)
        await page.wait_for_selector("#conversation .bubble.assistant:not(.streaming)")
        assert await _bubbles(page) == [
            ["system", "Be brief.", False],
            ["user", QUESTION, False],
            ["assistant", reply, False],
        ]
        assert await page.is_visible("#conversation .gen-summary")

        # a second request continues the session: its turns follow, live
        r = await c.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "And of Italy?"}],
                "max_tokens": 8,
                "seed": 4,
                "session_id": sid,
            },
        )
        assert r.status_code == 200, r.text
        reply2 = r.json()["choices"][0]["message"]["content"]
        await page.wait_for_function(
            "document.querySelectorAll('#conversation .bubble.assistant:not(.streaming)').length === 2"
        )
        shown = await _bubbles(page)
        assert [(b[0], b[1]) for b in shown] == [
            ("system", "Be brief."),
            ("user", QUESTION),
            ("assistant", reply),
            ("user", "And of Italy?"),
            ("assistant", reply2),
        ]
        assert not [b for b in shown for m in MARKERS if m in b[1]]

        # the token view, one click away: the history as the model saw it, markers and all
        await page.click("#view-toggle")
        await page.wait_for_selector("#conversation .seg.generation .tok")
        assert await page.query_selector("#conversation .bubble") is None
        assert "<|user|>" in (await page.text_content("#conversation") or "")
        assert "view=tokens" in page.url
        await page.click("#view-toggle")
        await page.wait_for_selector("#conversation .bubble.assistant")

        # the scrubber: opened part-way into the first reply, the conversation is what it was then
        evs = await server.runtime.log.read(sid)
        tokens = [e for e in evs if e.type == "generation.token"]
        mid = tokens[4].position
        await page.goto(f"{server.url}/#/s/{sid}?at={mid}")
        await page.wait_for_selector("#mode:text('replay')")
        await page.wait_for_function(
            "document.querySelectorAll('#conversation .bubble').length === 3"
        )
        then = await _bubbles(page)
        assert [b[0] for b in then] == ["system", "user", "assistant"]
        assert then[2][2] and reply.startswith(then[2][1]) and len(then[2][1]) < len(reply)
        # before the request was recorded: no conversation yet, the token view shows the history
        await page.eval_on_selector(
            "#scrub", "(el) => { el.value = 1; el.dispatchEvent(new Event('input')); }"
        )
        await page.wait_for_function("!document.querySelector('#conversation .bubble')")
        assert await page.is_hidden("#view-toggle")

        # laid out cleanly on a desktop and on a phone
        await page.goto(f"{server.url}/#/s/{sid}")
        ARTIFACTS.mkdir(exist_ok=True)
        for width, height in ((1280, 800), (390, 844)):
            await page.set_viewport_size({"width": width, "height": height})
            await page.wait_for_function(
                "document.querySelectorAll('#conversation .bubble').length === 5"
            )
            await page.evaluate(
                "() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))"
            )
            shot = ARTIFACTS / f"viewer-chat-{width}x{height}.png"
            await page.screenshot(path=str(shot), full_page=True)
            problems = await page.evaluate(LAYOUT_CHECK)
            assert problems == [], (width, problems[:10])

        # re-run the first reply from the page: the fork keeps the conversation up to there, and
        # shows the new generation (a plain generate, no chat request) as the model's bubble
        await page.click("#conversation .gen-summary >> nth=0 >> button.rerun")
        await page.wait_for_selector("#conversation .bubble.generation:not(.streaming)")
        forked = await _bubbles(page)
        assert [b[0] for b in forked] == ["system", "user", "model"]
        assert await page.eval_on_selector_all(
            "#conversation .bubble.inherited", "els => els.map((e) => e.dataset.role)"
        ) == ["system", "user"]
        assert sid not in page.url
