"""The replay viewer in headless Chromium (Debian's /usr/bin/chromium driven by playwright)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from tests.helpers.http import Served
from tests.helpers.viewer import MARKS

pytestmark = MARKS


async def _session(c: httpx.AsyncClient, label: str) -> str:
    sid = str((await c.post("/v1/sessions", json={"label": label})).json()["id"])
    await c.post(f"/v1/sessions/{sid}/append", json={"text": "Hello viewer"})
    return sid


async def test_list_live_session_and_scrubber(server: Served, page: Any) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as c:
        done = await _session(c, "finished one")
        await c.post(
            f"/v1/sessions/{done}/generate", json={"max_tokens": 6, "seed": 1, "stream": False}
        )
        await c.post(f"/v1/sessions/{done}/close")

        # the list, updated live
        await page.goto(server.url + "/")
        await page.wait_for_selector(f"tr[data-id='{done}'].status-closed")
        live = await _session(c, "live one")
        await page.wait_for_selector(f"tr[data-id='{live}'].status-open")

        # a live session: tokens appear while it generates
        await page.goto(f"{server.url}/#/s/{live}")
        await page.wait_for_selector("#mode:text('live')")
        await c.post(
            f"/v1/sessions/{live}/generate",
            json={"max_tokens": 60, "seed": 3, "background": True, "logprob_top_k": 2},
        )
        await page.wait_for_function("document.querySelectorAll('#conversation .tok').length >= 3")
        first = await page.eval_on_selector_all("#conversation .tok", "els => els.length")
        await page.wait_for_function(
            f"document.querySelectorAll('#conversation .tok').length > {first}"
        )
        title = await page.get_attribute("#conversation .tok", "title")
        assert title is not None and "logprob" in title and "top:" in title
        for _ in range(300):
            if not server.runtime.generations.is_running(live):
                break
            await asyncio.sleep(0.02)
        doc = (await c.get(f"/v1/sessions/{live}")).json()
        n = len(doc["generations"][0]["tokens"])
        await page.wait_for_function(
            f"document.querySelectorAll('#conversation .tok').length === {n}"
        )
        assert "verified" in (await page.text_content("#audit") or "")

        # a finished session: scrub to the start, to the middle, and play
        await page.goto(f"{server.url}/#/s/{done}")
        await page.wait_for_selector("#scrub")
        steps = int(await page.get_attribute("#scrub", "max") or 0)
        assert steps == len(await server.runtime.log.read(done))
        full = await page.eval_on_selector_all("#conversation .tok", "els => els.length")
        assert full >= 1
        await page.eval_on_selector(
            "#scrub", "(el) => { el.value = 2; el.dispatchEvent(new Event('input')); }"
        )
        await page.wait_for_function("document.querySelectorAll('#conversation .tok').length === 0")
        assert "Hello viewer" in (await page.text_content("#conversation") or "")
        assert "event 2/" in (await page.text_content("#step") or "")
        await page.select_option("#speed", "64")
        await page.click("#play")
        await page.wait_for_function(
            f"document.querySelectorAll('#conversation .tok').length === {full}"
        )
        await page.wait_for_selector("#status:text('closed')")
