"""SSE over real uvicorn on loopback: snapshot + JSON Patch+, exact Last-Event-ID resume, list stream."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import jsonpatch
import pytest

from sessiontape.core.engine.interface import SamplingParams
from sessiontape.core.generation.request import GenerateRequest
from sessiontape.core.patch import apply_patch
from sessiontape.core.runtime import Runtime
from sessiontape.transports.http.native.list_feed import list_stream
from tests.helpers.http import Served, serving
from tests.helpers.sse_client import SseEvent, events


async def _session(c: httpx.AsyncClient, text: str = "Once upon a time") -> str:
    r = await c.post("/v1/sessions", json={"label": "sse"})
    sid = str(r.json()["id"])
    await c.post(f"/v1/sessions/{sid}/append", json={"text": text})
    return sid


async def _generate_in_background(c: httpx.AsyncClient, sid: str, n: int = 40) -> None:
    r = await c.post(
        f"/v1/sessions/{sid}/generate",
        json={"max_tokens": n, "seed": 5, "background": True, "logprob_top_k": 2},
    )
    assert r.status_code == 202, r.text


def _finished(doc: dict[str, Any]) -> bool:
    return bool(doc["generations"]) and doc["generations"][-1]["status"] == "finished"


async def _watch_with_cut(
    s: Served, c: httpx.AsyncClient, sid: str, *, rfc: bool = False
) -> tuple[dict[str, Any], list[int], int]:
    """Watch a generating session, drop the connection after a few patches, resume, read to the end."""
    q = {"patch": "rfc6902"} if rfc else {}
    ids: list[int] = []
    doc: dict[str, Any] = {}
    snapshot_id = 0

    def apply(ev: SseEvent) -> None:
        nonlocal doc
        ops = ev.json()
        if rfc:
            assert all(op["op"] != "append" for op in ops)
            doc = jsonpatch.apply_patch(doc, ops)
        else:
            doc = apply_patch(doc, ops)
        assert ev.id is not None
        ids.append(ev.id)

    async with c.stream("GET", f"/v1/sessions/{sid}/events", params=q) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        async for ev in events(resp):
            if ev.event == "snapshot":
                doc, snapshot_id = ev.json(), int(ev.id or 0)
            elif ev.event == "patch":
                apply(ev)
                if len(ids) == 5:
                    break  # the connection is closed here, mid-generation
    assert not _finished(doc)
    await asyncio.sleep(0.15)  # events commit while nobody listens
    closed = False
    async with c.stream(
        "GET", f"/v1/sessions/{sid}/events", params=q, headers={"Last-Event-ID": str(ids[-1])}
    ) as resp:
        async for ev in events(resp):
            assert ev.event != "snapshot"
            if ev.event == "patch":
                apply(ev)
                if _finished(doc) and not closed:
                    closed = True
                    assert (await c.post(f"/v1/sessions/{sid}/close")).status_code == 200
            elif ev.event == "end":
                assert ev.json()["status"] == "closed"
                break
    return doc, ids, snapshot_id


@pytest.mark.parametrize("linger_s", [30.0, 0.0], ids=["resume-from-ring", "resume-from-log"])
async def test_resume_after_a_cut_is_exact(sqlite_url: str, port: int, linger_s: float) -> None:
    async with serving(sqlite_url, port, step_delay_s=0.02, linger_s=linger_s) as s:
        async with httpx.AsyncClient(base_url=s.url, timeout=20) as c:
            sid = await _session(c)
            await _generate_in_background(c, sid)
            doc, ids, snapshot_id = await _watch_with_cut(s, c, sid)
            logged = (await c.get(f"/v1/sessions/{sid}")).json()
        assert doc == logged
        positions = [e.position for e in await s.runtime.log.read(sid) if e.position > snapshot_id]
        assert ids == positions  # no gap, no duplicate
        assert doc["generations"][0]["finish_reason"] in ("length", "eos")


async def test_rfc6902_fallback_stream(server: Served) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as c:
        sid = await _session(c)
        await _generate_in_background(c, sid, 20)
        doc, _, _ = await _watch_with_cut(server, c, sid, rfc=True)
        assert doc == (await c.get(f"/v1/sessions/{sid}")).json()


async def test_generate_stream_and_client_cancel(server: Served) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as c:
        sid = await _session(c)
        seen: list[SseEvent] = []
        async with c.stream(
            "POST", f"/v1/sessions/{sid}/generate", json={"max_tokens": 8, "seed": 2}
        ) as resp:
            assert resp.status_code == 200
            async for ev in events(resp):
                seen.append(ev)
        assert seen[0].event == "snapshot" and all(ev.event == "patch" for ev in seen[1:])
        doc = seen[0].json()
        for ev in seen[1:]:
            doc = apply_patch(doc, ev.json())
        assert _finished(doc) and doc == (await c.get(f"/v1/sessions/{sid}")).json()
        # dropping the generate stream stops the generation, recorded as cancelled
        async with c.stream(
            "POST", f"/v1/sessions/{sid}/generate", json={"max_tokens": 200, "seed": 2}
        ) as resp:
            n = 0
            async for ev in events(resp):
                n += ev.event == "patch"
                if n == 3:
                    break
        for _ in range(100):
            doc = (await c.get(f"/v1/sessions/{sid}")).json()
            if _finished(doc):
                break
            await asyncio.sleep(0.05)
        assert doc["generations"][-1]["finish_reason"] == "cancelled"
        assert len(doc["generations"][-1]["tokens"]) < 200
        # a busy session is an HTTP error before any stream starts
        for _ in range(500):  # the runtime lets go of the session just after recording the cancel
            if not server.runtime.generations.is_running(sid):
                break
            await asyncio.sleep(0.01)
        await _generate_in_background(c, sid, 50)
        r = await c.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 2})
        assert r.status_code == 409 and r.json()["error"]["code"] == "session_busy"


async def test_finished_session_snapshot_and_resume(server: Served) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as c:
        sid = await _session(c)
        await c.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 5, "stream": False})
        await c.post(f"/v1/sessions/{sid}/close")
        final = (await c.get(f"/v1/sessions/{sid}")).json()
        async with c.stream("GET", f"/v1/sessions/{sid}/events") as resp:
            got = [ev async for ev in events(resp)]
        assert [ev.event for ev in got] == ["snapshot", "end"] and got[0].json() == final
        evs = await server.runtime.log.read(sid)
        mid = evs[2].position
        v3 = (await c.get(f"/v1/sessions/{sid}", params={"version": 3})).json()
        async with c.stream(
            "GET", f"/v1/sessions/{sid}/events", headers={"Last-Event-ID": str(mid)}
        ) as resp:
            got = [ev async for ev in events(resp)]
        assert [ev.id for ev in got if ev.event == "patch"] == [e.position for e in evs[3:]]
        doc = copy.deepcopy(v3)
        for ev in got[:-1]:
            doc = apply_patch(doc, ev.json())
        assert doc == final and got[-1].event == "end"
        r = await c.get(f"/v1/sessions/{sid}/events", headers={"Last-Event-ID": "999999"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_parameters"
        r = await c.get(f"/v1/sessions/{sid}/events", headers={"Last-Event-ID": "abc"})
        assert r.status_code == 400
        # blank is malformed too, not "from the start" (docs/protocols/http.md), whatever the query
        for blank, query in (("", {}), ("", {"last_event_id": str(mid)})):
            r = await c.get(
                f"/v1/sessions/{sid}/events", headers={"Last-Event-ID": blank}, params=query
            )
            assert r.status_code == 400, (blank, query)
            assert r.json()["error"]["code"] == "invalid_parameters"
            assert "Last-Event-ID" in r.json()["error"]["message"]
        r = await c.get(f"/v1/sessions/{sid}/events", params={"last_event_id": ""})
        assert r.status_code == 400


async def test_sessions_list_stream_and_heartbeat(server: Served) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as c:
        comments: list[str] = []
        async with c.stream("GET", "/v1/sessions/events") as resp:
            it = events(resp, comments=comments)
            snap = await anext(it)
            assert snap.event == "snapshot" and snap.json() == {"sessions": {}}
            doc = snap.json()
            sid = await _session(c)
            await c.post(f"/v1/sessions/{sid}/close")
            while sid not in doc["sessions"] or doc["sessions"][sid]["status"] != "closed":
                ev = await anext(it)
                if ev.event == "patch":
                    doc = apply_patch(doc, ev.json())
            assert doc["sessions"][sid]["label"] == "sse"
            while (
                await anext(it)
            ).event != "comment":  # idle: heartbeats (heartbeat_s=1 in the fixture)
                pass
            assert comments[0].startswith(": ping")


async def test_a_lagging_sessions_list_watcher_is_dropped_not_buffered(runtime: Runtime) -> None:
    """More list changes than the watcher's queue holds, unread: its stream ends (the client reconnects)."""
    stream = list_stream(runtime, queue_max=3, heartbeat_s=60.0)
    assert (await anext(stream)).startswith(b"id: ")
    for _ in range(10):
        await runtime.open_session("http")
        s = await runtime.open_session("http")
        async for _e in runtime.generate(
            s.session_id, GenerateRequest(SamplingParams(max_tokens=3, seed=1))
        ):
            pass  # tokens are not list changes: they never reach the list watcher's queue
    rest = await asyncio.wait_for(_drain(stream), 30)
    assert rest == []
    # a watcher that keeps up gets every change
    stream = list_stream(runtime, queue_max=3, heartbeat_s=60.0)
    doc = json.loads((await anext(stream)).decode().split("data: ", 1)[1])
    sid = (await runtime.open_session("http", label="kept up")).session_id
    patch = json.loads((await anext(stream)).decode().split("data: ", 1)[1])
    await stream.aclose()
    assert apply_patch(doc, patch)["sessions"][sid]["label"] == "kept up"


async def _drain(stream: AsyncIterator[bytes]) -> list[bytes]:
    return [chunk async for chunk in stream]


async def _generate_stream(
    c: httpx.AsyncClient, sid: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> list[SseEvent]:
    async with c.stream(
        "POST", f"/v1/sessions/{sid}/generate", json=body, headers=headers or {}
    ) as resp:
        assert resp.status_code == 200, await resp.aread()
        return [ev async for ev in events(resp)]


@pytest.mark.parametrize("ring", [4096, 1])
async def test_generate_stream_resumed_from_last_event_id_sends_only_patches(
    sqlite_url: str, port: int, ring: int
) -> None:
    """A client holding the document up to Last-Event-ID gets no snapshot on its next turn:
    the patches after that position (another client's append included), exactly, from the
    live feed's ring or, where the ring does not reach back (``ring = 1``), from the log."""
    async with serving(sqlite_url, port, ring=ring) as server:
        await _resumed_turns(server)


async def _resumed_turns(server: Served) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as c:
        sid = await _session(c)
        first = await _generate_stream(c, sid, {"max_tokens": 4, "seed": 2})
        assert first[0].event == "snapshot"
        doc = first[0].json()
        for ev in first[1:]:
            doc = apply_patch(doc, ev.json())
        last = first[-1].id
        assert last is not None
        # something happens between the turns that this client did not watch
        for text in (" and", " then"):  # two events: past a ring of one
            await c.post(f"/v1/sessions/{sid}/append", json={"text": text})
        second = await _generate_stream(
            c, sid, {"max_tokens": 5, "seed": 3, "text": "!"}, {"Last-Event-ID": str(last)}
        )
        assert second and all(ev.event == "patch" for ev in second)
        ids = [ev.id for ev in second]
        assert all(i is not None and i > last for i in ids) and ids == sorted(set(ids))
        for ev in second:
            doc = apply_patch(doc, ev.json())
        assert doc == (await c.get(f"/v1/sessions/{sid}")).json()
        assert _finished(doc) and len(doc["generations"]) == 2
        assert bytes(doc["history"]["ids"][-len(doc["generations"][1]["tokens"]) - 10 :][:10]) == (
            b" and then!"
        )


@pytest.mark.parametrize("bad", ["", "x", "-1", "10000000", str(2**70), "1e3", "nan"])
async def test_generate_stream_with_a_bad_last_event_id_is_refused_before_generating(
    server: Served, bad: str
) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as c:
        sid = await _session(c)
        before = (await c.get(f"/v1/sessions/{sid}")).json()
        r = await c.post(
            f"/v1/sessions/{sid}/generate",
            json={"max_tokens": 3, "text": "more"},
            headers={"Last-Event-ID": bad},
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_parameters"
        assert "Last-Event-ID" in r.json()["error"]["message"]
        assert (await c.get(f"/v1/sessions/{sid}")).json() == before


async def test_closing_a_watched_session_answers_its_feeds_document_as_the_log_has_it(
    sqlite_url: str, port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sessiontape.transports.http.native import routes as app_module

    folded: list[str] = []
    real = app_module.load_builder

    async def counted(*args: Any, **kwargs: Any) -> Any:
        folded.append(args[2])
        return await real(*args, **kwargs)

    async with (
        serving(sqlite_url, port) as s,
        httpx.AsyncClient(base_url=s.url, timeout=20) as c,
    ):
        watched, unwatched = await _session(c), await _session(c)
        # a streamed generation leaves the session's live feed behind it (it lingers)
        async with c.stream(
            "POST", f"/v1/sessions/{watched}/generate", json={"max_tokens": 12, "seed": 3}
        ) as resp:
            assert "patch" in [ev.event async for ev in events(resp)]
        await c.post(
            f"/v1/sessions/{unwatched}/generate",
            json={"max_tokens": 12, "seed": 3, "stream": False},
        )
        await c.post(f"/v1/sessions/{watched}/fork", json={})  # a child the feed saw live
        monkeypatch.setattr(app_module, "load_builder", counted)
        closed = {sid: await c.post(f"/v1/sessions/{sid}/close") for sid in (watched, unwatched)}
        # the watched session's answer came from its feed; the other's from the log
        assert folded == [unwatched]
        monkeypatch.undo()
        for sid, r in closed.items():
            assert r.status_code == 200
            fresh = (await c.get(f"/v1/sessions/{sid}")).json()
            assert r.json() == fresh and fresh["status"] == "closed"
        assert len(closed[watched].json()["children"]) == 1
