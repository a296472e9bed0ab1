"""The viewer as people use it: summaries inline, search and filters, a session opened at a
log position, forks and re-runs from the page, and layouts that hold at desktop and phone sizes.

Headless Debian Chromium through playwright, a real uvicorn on loopback, the reference engine.
Screenshots go to test-artifacts/ (viewer-*.png).
"""

from __future__ import annotations

import asyncio
import datetime
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from sessiontape.core.nodes import FragmentIn
from tests.helpers.http import Served
from tests.helpers.viewer import ARTIFACTS, LAYOUT_CHECK, MARKS

pytestmark = MARKS


async def _gen(c: httpx.AsyncClient, sid: str, **params: Any) -> dict[str, Any]:
    r = await c.post(f"/v1/sessions/{sid}/generate", json={"stream": False, **params})
    assert r.status_code == 200, r.text
    return dict(r.json()["generation"])


async def _two_turns(
    server: Served, c: httpx.AsyncClient, label: str
) -> tuple[str, list[dict[str, Any]]]:
    sid = (await c.post("/v1/sessions", json={"label": label})).json()["id"]
    await c.post(f"/v1/sessions/{sid}/append", json={"text": "Hello viewer"})
    g1 = await _gen(c, sid, max_tokens=5, seed=1, temperature=0.7, logprob_top_k=2)
    await c.post(f"/v1/sessions/{sid}/feedback", json={"score": 8, "comment": "good"})
    await c.post(f"/v1/sessions/{sid}/append", json={"text": " and again"})
    g2 = await _gen(c, sid, max_tokens=40, seed=2)
    await server.runtime.record_error(sid, "tool_failed", "the calculator timed out")
    await c.post(f"/v1/sessions/{sid}/close", json={})
    return sid, [g1, g2]


async def test_generation_summaries_sit_where_they_happened(server: Served, page: Any) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as c:
        sid, (g1, g2) = await _two_turns(server, c, "inline")
        ev = (await server.runtime.open_session("evergreen", label="actions")).session_id
        await server.runtime.nodes.append_fragments(
            ev,
            [FragmentIn(id="p", has_chunk=True, data=b"2+2?", metadata={"mimetype": "text/plain"})],
        )
        await server.runtime.nodes.submit_action(
            ev, "GENERATE", [("prompt", "p")], [("text", "o1")]
        )
        await server.runtime.nodes.finish_action(ev, "a1", ("engine_error", "the engine went away"))

    await page.set_viewport_size({"width": 1280, "height": 800})
    await page.goto(f"{server.url}/#/s/{sid}")
    await page.wait_for_selector(".gen-summary >> nth=1")
    order = await page.eval_on_selector_all(
        "#conversation > *",
        "els => els.map(e => e.className.split(' ').slice(0, 2).join(' ') + (e.dataset.gen ? ':' + e.dataset.gen : ''))",
    )
    assert order == [
        "seg input",
        "seg generation",
        f"gen-summary:{g1['id']}",
        "fb",
        "seg input",
        "seg generation",
        f"gen-summary:{g2['id']}",
        "err",
    ]
    # a role label where the speaker changes, not on every block
    assert await page.eval_on_selector_all(".seg .who", "els => els.map(e => e.textContent)") == [
        "input",
        "model",
        "input",
        "model",
    ]
    first = await page.text_content(f".gen-summary[data-gen='{g1['id']}']") or ""
    for words in (
        "length",
        "5 tokens in",
        "max_tokens 5",
        "temperature 0.7",
        "seed 1",
        "top-k logprobs 2",
    ):
        assert words in first, (words, first)
    assert "seed 2" in (await page.text_content(f".gen-summary[data-gen='{g2['id']}']") or "")
    assert "score 8" in (await page.text_content(".fb") or "") and "comment good" in (
        await page.text_content(".fb") or ""
    )
    err = await page.text_content("#conversation .err") or ""
    assert "tool_failed" in err and "the calculator timed out" in err

    await page.goto(f"{server.url}/#/s/{ev}")
    await page.wait_for_selector("#actions li")
    action = await page.text_content("#actions li") or ""
    for words in ("GENERATE", "a1", "failed", "prompt=p", "text=o1", "the engine went away"):
        assert words in action, (words, action)


async def test_runs_list_search_and_filters(server: Served, page: Any) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as c:
        ids = {}
        for label in ("alpha run", "beta run", "gamma"):
            ids[label] = (await c.post("/v1/sessions", json={"label": label})).json()["id"]
        await c.post(f"/v1/sessions/{ids['beta run']}/close", json={})

    await page.goto(server.url + "/")
    await page.wait_for_selector("tr.session-row >> nth=2")

    async def shown() -> set[str]:
        return set(
            await page.eval_on_selector_all("tr.session-row", "els => els.map(e => e.dataset.id)")
        )

    assert await shown() == set(ids.values())
    await page.fill("#filter-q", "RUN")
    assert await shown() == {ids["alpha run"], ids["beta run"]}
    assert (await page.text_content("#filter-count")) == "2 of 3 sessions"
    await page.select_option("#filter-status", "closed")
    assert await shown() == {ids["beta run"]}
    await page.fill("#filter-q", ids["gamma"][-8:])  # by id
    await page.select_option("#filter-status", "")
    assert await shown() == {ids["gamma"]}
    await page.fill("#filter-q", "")
    today = datetime.date.today()
    await page.fill("#filter-from", (today + datetime.timedelta(days=1)).isoformat())
    assert await shown() == set()
    await page.fill("#filter-from", (today - datetime.timedelta(days=1)).isoformat())
    await page.fill("#filter-to", today.isoformat())
    assert await shown() == set(ids.values())
    # the filters live in the URL: a reload (or a shared link) keeps them
    await page.fill("#filter-q", "alpha")
    await page.wait_for_function("location.hash.includes('q=alpha')")
    await page.reload()
    await page.wait_for_selector(f"tr[data-id='{ids['alpha run']}']")
    assert await page.input_value("#filter-q") == "alpha" and await shown() == {ids["alpha run"]}


async def test_the_list_shows_what_each_session_is_about(server: Served, page: Any) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as c:
        story = (await c.post("/v1/sessions", json={"label": "tale"})).json()["id"]
        await c.post(f"/v1/sessions/{story}/append", json={"text": "Once upon a time"})
        bare = (await c.post("/v1/sessions", json={})).json()["id"]
        await c.post(f"/v1/sessions/{bare}/append", json={"text": "Dear diary"})

    await page.goto(server.url + "/")
    await page.wait_for_selector(f"tr[data-id='{bare}'] .preview")
    assert await page.text_content(f"tr[data-id='{story}'] .col-label .label") == "tale"
    assert await page.text_content(f"tr[data-id='{story}'] .preview") == "Once upon a time"
    assert await page.text_content(f"tr[data-id='{bare}'] .preview") == "Dear diary"
    await page.fill("#filter-q", "diary")  # the search reads the preview too
    await page.wait_for_function("document.querySelectorAll('tr.session-row').length === 1")
    assert await page.get_attribute("tr.session-row", "data-id") == bare


async def test_open_at_a_log_position_and_find_in_the_session(server: Served, page: Any) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as c:
        sid, (g1, g2) = await _two_turns(server, c, "positions")
    evs = await server.runtime.log.read(sid)
    finished = next(e for e in evs if e.type == "generation.finished")

    await page.goto(f"{server.url}/#/s/{sid}?at={finished.position}")
    await page.wait_for_selector(f".gen-summary[data-gen='{g1['id']}']")
    assert await page.eval_on_selector("#scrub", "el => Number(el.value)") == finished.version
    assert await page.eval_on_selector_all(".gen-summary", "els => els.length") == 1
    assert await page.eval_on_selector_all("#conversation .tok", "els => els.length") == len(
        g1["tokens"]
    )
    assert f"position {finished.position}" in (await page.text_content("#step") or "")
    # moving the scrubber moves the URL, so the link names what is on screen
    await page.eval_on_selector(
        "#scrub", "(el) => { el.value = 2; el.dispatchEvent(new Event('input')); }"
    )
    await page.wait_for_function("location.hash.includes('at=2')")

    await page.fill("#find", "again")
    # at event 2 the second turn has not happened
    await page.wait_for_function(
        "document.querySelector('#find-count').textContent === '0 matches'"
    )
    await page.eval_on_selector(
        "#scrub", f"(el) => {{ el.value = {len(evs)}; el.dispatchEvent(new Event('input')); }}"
    )
    await page.wait_for_function("document.querySelector('#find-count').textContent === '1 match'")
    assert (await page.text_content("#conversation mark")) == "again"
    await page.wait_for_function("location.hash.includes('find=again')")
    # a search in the URL is run on arrival, also across generated tokens
    words = [
        t["text"]
        for g in (g1, g2)
        for t in g["tokens"]
        if t["text"] and t["text"].isascii() and t["text"].isalnum()
    ]
    assert words, "the reference engine generated no letter or digit to search for"
    text = words[0]
    await page.goto(f"{server.url}/#/s/{sid}?find={quote(text)}")
    await page.wait_for_selector("#conversation .tok.hit")
    hit = await page.eval_on_selector_all(
        "#conversation .tok.hit", "els => els.map(e => e.textContent).join('')"
    )
    assert text in hit


async def test_fork_and_rerun_from_the_page(server: Served, page: Any) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as c:
        sid = (await c.post("/v1/sessions", json={"label": "source"})).json()["id"]
        await c.post(f"/v1/sessions/{sid}/append", json={"text": "Hello viewer"})
        g = await _gen(c, sid, max_tokens=8, seed=5, temperature=0.9)
        await c.post(f"/v1/sessions/{sid}/close", json={})

        await page.goto(f"{server.url}/#/s/{sid}")
        await page.wait_for_selector("#conversation .tok >> nth=3")
        # a token: fork before it, through POST /fork
        third = g["tokens"][2]
        await page.click(f"#conversation .tok[data-pos='{third['position']}']")
        await page.click("#fork-token")
        await page.wait_for_function(
            f"location.hash.startsWith('#/s/') && !location.hash.includes('{sid}')"
        )
        child = page.url.split("#/s/")[1].split("?")[0]
        doc = (await c.get(f"/v1/sessions/{child}")).json()
        assert doc["parent"] == {
            "session_id": sid,
            "token_position": third["position"],
            "version": doc["parent"]["version"],
        }
        assert doc["history"]["ids"] == [
            *(await c.get(f"/v1/sessions/{sid}")).json()["history"]["ids"][: third["position"]]
        ]
        # ... and every other client sees it: the source lists the fork
        assert child in [
            x["session_id"] for x in (await c.get(f"/v1/sessions/{sid}")).json()["children"]
        ]

        # a generation: re-run it with the same parameters in a fork; the reference engine repeats itself
        await page.goto(f"{server.url}/#/s/{sid}")
        await page.click(f".rerun[data-gen='{g['id']}']")
        await page.wait_for_function(
            f"location.hash.startsWith('#/s/') && !location.hash.includes('{sid}') "
            f"&& !location.hash.includes('{child}')"
        )
        rerun = page.url.split("#/s/")[1].split("?")[0]
        for _ in range(500):
            again = (await c.get(f"/v1/sessions/{rerun}")).json()
            if again["generations"] and again["generations"][0]["status"] == "finished":
                break
            await asyncio.sleep(0.02)
        [g2] = again["generations"]
        assert again["parent"]["token_position"] == g["prompt_length"]
        assert (
            g2["params"]["seed"] == 5
            and g2["params"]["temperature"] == 0.9
            and g2["params"]["max_tokens"] == 8
        )
        assert [t["id"] for t in g2["tokens"]] == [t["id"] for t in g["tokens"]]
        await page.wait_for_function(
            f"document.querySelectorAll('#conversation .tok').length === {len(g['tokens'])}"
        )

        # the scrubber: fork the session as it was at an event
        await page.goto(f"{server.url}/#/s/{sid}?at=2")
        await page.wait_for_selector("#fork-here:not([disabled])")
        await page.click("#fork-here")
        await page.wait_for_function(
            f"location.hash.startsWith('#/s/') && !location.hash.includes('{sid}')"
        )
        at_v2 = (await c.get(f"/v1/sessions/{page.url.split('#/s/')[1].split('?')[0]}")).json()
        assert at_v2["parent"]["version"] == 2 and at_v2["history"]["text"] == "Hello viewer"


async def test_fork_after_a_node(server: Served, page: Any) -> None:
    rt = server.runtime
    sid = (await rt.open_session("evergreen", label="nodes")).session_id
    await rt.nodes.append_fragments(
        sid,
        [
            FragmentIn(
                id="p", has_chunk=True, data=b"first node", metadata={"mimetype": "text/plain"}
            )
        ],
    )
    await rt.nodes.append_fragments(
        sid,
        [
            FragmentIn(
                id="q", has_chunk=True, data=b"second node", metadata={"mimetype": "text/plain"}
            )
        ],
    )
    await rt.close(sid)
    p_version = next(
        e.version
        for e in await rt.log.read(sid)
        if e.type == "node.fragment" and e.body["id"] == "p"
    )

    await page.goto(f"{server.url}/#/s/{sid}")
    await page.click(".fork-node[data-node='p']")
    await page.wait_for_function(
        f"location.hash.startsWith('#/s/') && !location.hash.includes('{sid}')"
    )
    child = page.url.split("#/s/")[1].split("?")[0]
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as c:
        doc = (await c.get(f"/v1/sessions/{child}")).json()
    assert doc["parent"]["session_id"] == sid and doc["parent"]["version"] == p_version
    assert set(doc["nodes"]) == {"p"} and doc["nodes"]["p"]["text"] == "first node"
    await page.wait_for_selector("li[data-node='p']")


@pytest.mark.parametrize(("width", "height"), [(1280, 800), (390, 844)])
async def test_long_and_forked_sessions_lay_out_cleanly(
    server: Served,
    page: Any,
    width: int,
    height: int,
) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
        sid = (
            await c.post(
                "/v1/sessions",
                json={
                    "label": "a long conversation whose label is long enough to need wrapping on a phone"
                },
            )
        ).json()["id"]
        for turn in range(12):
            await c.post(
                f"/v1/sessions/{sid}/append",
                json={"text": f"Turn {turn}: tell me more about item {turn}. "},
            )
            await _gen(c, sid, max_tokens=40, seed=turn, temperature=0.8, logprob_top_k=2)
            if turn % 4 == 1:
                await c.post(
                    f"/v1/sessions/{sid}/feedback", json={"score": turn, "comment": "x" * 120}
                )
        await c.post(f"/v1/sessions/{sid}/append", json={"text": "an-unbroken-run-of-text-" * 12})
        mid = (await c.get(f"/v1/sessions/{sid}")).json()["generations"][5]
        fork = (
            await c.post(
                f"/v1/sessions/{sid}/fork",
                json={"at_position": mid["prompt_length"] + 10, "label": "fork of the long one"},
            )
        ).json()["id"]
        await _gen(c, fork, max_tokens=30, seed=99)
        await c.post(f"/v1/sessions/{sid}/close", json={})
        await c.post(f"/v1/sessions/{fork}/close", json={})
        for i in range(8):
            await c.post("/v1/sessions", json={"label": f"filler session {i}"})

    await page.set_viewport_size({"width": width, "height": height})
    ARTIFACTS.mkdir(exist_ok=True)
    shots = [
        ("list", "/", "tr.session-row >> nth=9"),
        ("long", f"/#/s/{sid}", ".gen-summary >> nth=11"),
        ("forked", f"/#/s/{fork}", ".gen-summary"),
    ]
    for name, path, ready in shots:
        await page.goto(server.url + path)
        await page.wait_for_selector(ready)
        await page.evaluate(
            "() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))"
        )
        await page.screenshot(
            path=str(ARTIFACTS / f"viewer-{name}-{width}x{height}.png"), full_page=True
        )
        problems = await page.evaluate(LAYOUT_CHECK)
        assert problems == [], (name, problems[:10])
    # the token menu, opened on a phone or a desktop, fits the window too
    await page.click("#conversation .tok >> nth=2")
    await page.wait_for_selector("#tokmenu")
    await page.screenshot(path=str(ARTIFACTS / f"viewer-tokmenu-{width}x{height}.png"))
    box = await page.eval_on_selector(
        "#tokmenu",
        "el => { const r = el.getBoundingClientRect(); "
        "return [r.left, r.right, el.scrollWidth <= el.clientWidth]; }",
    )
    assert box[0] >= 0 and box[1] <= width and box[2]


def _frag(nid: str, text: str) -> list[FragmentIn]:
    return [
        FragmentIn(id=nid, has_chunk=True, data=text.encode(), metadata={"mimetype": "text/plain"})
    ]


async def test_fork_after_any_node_of_a_long_live_session_and_of_a_fork(
    server: Served,
    page: Any,
) -> None:
    """Every node offers "fork after": those that arrive while the page follows the session live
    (late in a long session: past the replay it loaded), and those a fork inherited."""
    rt = server.runtime
    sid = (await rt.open_session("evergreen", label="many nodes")).session_id
    for i in range(300):  # more than one of the scrubber's 256-step checkpoints
        await rt.nodes.append_fragments(sid, _frag(f"n{i}", f"node {i}"))

    await page.goto(f"{server.url}/#/s/{sid}")
    await page.wait_for_selector("#mode:text('live')")
    await page.wait_for_selector("li[data-node='n299']")
    for i in range(300, 306):  # late: after the page loaded
        await rt.nodes.append_fragments(sid, _frag(f"n{i}", f"node {i}"))
    await page.wait_for_selector("li[data-node='n305']")
    buttons = await page.eval_on_selector_all(".fork-node", "els => els.map(e => e.dataset.node)")
    assert sorted(buttons) == sorted(f"n{i}" for i in range(306))
    v303 = next(
        e.version
        for e in await rt.log.read(sid)
        if e.type == "node.fragment" and e.body["id"] == "n303"
    )
    await page.click(".fork-node[data-node='n303']")
    await page.wait_for_function(f"!location.hash.includes('{sid}')")
    child = page.url.split("#/s/")[1].split("?")[0]
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as c:
        doc = (await c.get(f"/v1/sessions/{child}")).json()
        assert doc["parent"] == {"session_id": sid, "version": v303, "token_position": None}
        assert set(doc["nodes"]) == {f"n{i}" for i in range(304)}

        # the fork's inherited nodes can be forked after too (from the fork's first version)
        await page.wait_for_selector("li[data-node='n303'] .fork-node")
        assert await page.eval_on_selector_all(".fork-node", "els => els.length") == 304
        await page.click(".fork-node[data-node='n10']")
        await page.wait_for_function(f"!location.hash.includes('{child}')")
        grandchild = page.url.split("#/s/")[1].split("?")[0]
        gdoc = (await c.get(f"/v1/sessions/{grandchild}")).json()
        assert gdoc["parent"] == {"session_id": child, "version": 1, "token_position": None}
        assert gdoc["nodes"]["n10"]["text"] == "node 10"

    # scrubbed back, a node is forked as the page shows it then, not as it ended up
    await rt.nodes.append_fragments(sid, _frag("n0", " and more"))
    await rt.close(sid)
    first = next(e for e in await rt.log.read(sid) if e.type == "node.fragment")
    await page.goto(f"{server.url}/#/s/{sid}?at={first.position}")
    await page.wait_for_selector("li[data-node='n0'] .fork-node")
    await page.click(".fork-node[data-node='n0']")
    await page.wait_for_function(f"!location.hash.includes('{sid}')")
    early = page.url.split("#/s/")[1].split("?")[0]
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as c:
        edoc = (await c.get(f"/v1/sessions/{early}")).json()
    assert edoc["parent"]["version"] == first.version and set(edoc["nodes"]) == {"n0"}


async def test_rerun_keeps_a_seed_above_2_53_exact(server: Served, page: Any) -> None:
    """The document shows seeds as JSON integers; the page keeps the digits of one a JavaScript
    number would round, shows them, and re-runs with the very same seed."""
    seed = 2**64 - 1
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as c:
        sid = (await c.post("/v1/sessions", json={"label": "big seed"})).json()["id"]
        await c.post(f"/v1/sessions/{sid}/append", json={"text": "Hello viewer"})
        g = await _gen(c, sid, max_tokens=8, seed=seed, temperature=1.0)
        assert g["params"]["seed"] == seed
        await c.post(f"/v1/sessions/{sid}/close", json={})

        await page.goto(f"{server.url}/#/s/{sid}")
        await page.wait_for_selector(f".rerun[data-gen='{g['id']}']")
        summary = await page.text_content(f".gen-summary[data-gen='{g['id']}']") or ""
        assert f"seed {seed}" in summary, summary
        await page.click(f".rerun[data-gen='{g['id']}']")
        await page.wait_for_function(f"!location.hash.includes('{sid}')")
        rerun = page.url.split("#/s/")[1].split("?")[0]
        for _ in range(500):
            again = (await c.get(f"/v1/sessions/{rerun}")).json()
            if again["generations"] and again["generations"][0]["status"] == "finished":
                break
            await asyncio.sleep(0.02)
    [g2] = again["generations"]
    assert g2["params"]["seed"] == seed
    assert [t["id"] for t in g2["tokens"]] == [t["id"] for t in g["tokens"]]


async def _press(pg: Any, selector: str) -> None:
    """A person's click: press, hold a moment, release (a redraw in between must not lose it)."""
    box = await pg.eval_on_selector(
        selector,
        "el => { el.scrollIntoView({block: 'center'}); const r = el.getBoundingClientRect(); "
        "return [r.x + r.width / 2, r.y + r.height / 2]; }",
    )
    await pg.mouse.move(box[0], box[1])
    await pg.mouse.down()
    await asyncio.sleep(0.1)
    await pg.mouse.up()


async def test_fork_and_rerun_while_the_session_generates(server: Served, page: Any) -> None:
    """On a live session the page redraws on every committed token: a click on a re-run button or a
    token of an earlier generation still lands, and the fork it makes (while the parent generates)
    renders and re-runs with the same parameters."""
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as c:
        sid = (await c.post("/v1/sessions", json={"label": "busy"})).json()["id"]
        await c.post(f"/v1/sessions/{sid}/append", json={"text": "Hello viewer"})
        g = await _gen(c, sid, max_tokens=6, seed=4)
        await c.post(f"/v1/sessions/{sid}/append", json={"text": " and on"})
        await page.goto(f"{server.url}/#/s/{sid}")
        await page.wait_for_selector("#mode:text('live')")
        await page.wait_for_selector(f".rerun[data-gen='{g['id']}']")
        await c.post(
            f"/v1/sessions/{sid}/generate",
            json={"max_tokens": 2000, "seed": 5, "background": True},
        )
        await page.wait_for_selector(".finish.running")

        await _press(page, f".rerun[data-gen='{g['id']}']")
        await page.wait_for_function(f"!location.hash.includes('{sid}')", timeout=5000)
        rerun = page.url.split("#/s/")[1].split("?")[0]
        for _ in range(500):
            again = (await c.get(f"/v1/sessions/{rerun}")).json()
            if again["generations"] and again["generations"][0]["status"] == "finished":
                break
            await asyncio.sleep(0.02)
        [g2] = again["generations"]
        assert again["parent"]["token_position"] == g["prompt_length"]
        assert [t["id"] for t in g2["tokens"]] == [t["id"] for t in g["tokens"]]
        await page.wait_for_function(
            f"document.querySelectorAll('#conversation .tok').length === {len(g['tokens'])}"
        )

        await page.goto(f"{server.url}/#/s/{sid}")
        await page.wait_for_selector(f".rerun[data-gen='{g['id']}']")
        assert server.runtime.generations.is_running(sid)
        third = g["tokens"][2]
        await _press(page, f"#conversation .tok[data-pos='{third['position']}']")
        await page.wait_for_selector("#fork-token", timeout=5000)
        await _press(page, "#fork-token")
        await page.wait_for_function(f"!location.hash.includes('{sid}')", timeout=5000)
        child = page.url.split("#/s/")[1].split("?")[0]
        doc = (await c.get(f"/v1/sessions/{child}")).json()
        assert doc["parent"]["token_position"] == third["position"]
        assert server.runtime.generations.is_running(sid)  # all along
