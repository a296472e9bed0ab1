"""The JSON API over ASGI: routes, error mapping (every code -> status), data unchanged after bad input."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from typing import Any

import httpx
import pytest

import sessiontape.core.errors as E
from sessiontape.core.patch import apply_patch
from sessiontape.core.runtime import Runtime
from sessiontape.core.tokens import ImageIn
from sessiontape.engines.reference import IMAGE_PAD, ReferenceEngine
from sessiontape.transports.http.server.app import create_app
from sessiontape.transports.http.server.errors import (
    ClientGone,
    PayloadTooLarge,
    RequestTimeout,
    status_for,
)
from tests.helpers.config import make_config
from tests.helpers.http import Served


async def _open(c: httpx.AsyncClient, **body: Any) -> str:
    r = await c.post("/v1/sessions", json=body)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


async def _export(c: httpx.AsyncClient, sid: str) -> list[dict[str, Any]]:
    r = await c.get(f"/v1/sessions/{sid}/export")
    assert r.status_code == 200
    return [json.loads(line) for line in r.text.splitlines()]


async def test_session_lifecycle(client: httpx.AsyncClient) -> None:
    sid = await _open(client, label="api", meta={"k": 1})
    r = await client.post(f"/v1/sessions/{sid}/append", json={"text": "Hello"})
    assert r.json()["length"] == 5
    r = await client.post(
        f"/v1/sessions/{sid}/generate",
        json={"max_tokens": 4, "seed": 1, "stream": False, "logprob_top_k": 2},
    )
    assert r.status_code == 200, r.text
    gen = r.json()["generation"]
    assert gen["status"] == "finished" and 1 <= len(gen["tokens"]) <= 4
    doc = (await client.get(f"/v1/sessions/{sid}")).json()
    assert doc["history"]["ids"][:5] == list(b"Hello") and doc["meta"] == {"k": 1}
    v2 = (await client.get(f"/v1/sessions/{sid}", params={"version": 2})).json()
    assert v2["version"] == 2 and v2["history"]["ids"] == list(b"Hello") and v2["generations"] == []
    r = await client.post(f"/v1/sessions/{sid}/fork", json={"at_position": 3})
    assert r.status_code == 201
    child = r.json()
    assert child["parent"]["session_id"] == sid and child["history"]["ids"] == list(b"Hel")
    assert (await client.get("/v1/sessions", params={"parent": sid})).json()["sessions"][0][
        "id"
    ] == child["id"]
    r = await client.post(f"/v1/sessions/{sid}/close")
    assert r.json()["status"] == "closed"
    closed = (await client.get("/v1/sessions", params={"status": "closed"})).json()["sessions"]
    assert [s["id"] for s in closed] == [sid]
    lines = await _export(client, sid)
    assert [ln["version"] for ln in lines] == list(range(1, len(lines) + 1))
    audit = (await client.get(f"/v1/sessions/{sid}/audit")).json()
    assert audit == {
        "session_id": sid,
        "chain_ok": True,
        "invariants_ok": True,
        "problems": [],
        "ok": True,
    }
    assert (await client.get(f"/v1/sessions/{child['id']}/audit")).json()["ok"] is True


async def test_service_endpoints(client: httpx.AsyncClient) -> None:
    assert (await client.get("/healthz")).json()["status"] == "ok"
    sid = await _open(client)
    await client.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 2, "stream": False})
    metrics = (await client.get("/metrics")).text
    assert "sessiontape_tokens_generated_total" in metrics
    spec = (await client.get("/openapi.json")).json()
    assert spec["openapi"].startswith("3.") and "/v1/sessions/{sid}/events" in spec["paths"]
    index = await client.get("/")
    assert index.status_code == 200 and "<html" in index.text.lower()


def test_every_core_error_has_a_status() -> None:
    expected = {
        E.NotFound: 404,
        E.InvalidArgument: 400,
        E.FailedPrecondition: 409,
        E.ContextOverflow: 413,
        E.ResourceExhausted: 429,
        E.Aborted: 409,
        E.Unauthenticated: 401,
        E.ChainBroken: 500,
        E.InvalidEvent: 500,
        E.LogClosed: 503,
        E.LogUnavailable: 503,
        E.DatabaseInUse: 503,
        E.ConfigError: 500,
        E.EngineError: 502,
        PayloadTooLarge: 413,
        RequestTimeout: 408,
        ClientGone: 499,
    }
    seen = set()

    def walk(cls: type[E.SessiontapeError]) -> None:
        for sub in cls.__subclasses__():
            seen.add(sub)
            walk(sub)

    walk(E.SessiontapeError)
    for cls in seen:
        exc = cls.__new__(cls)
        family = next(k for k in cls.__mro__ if k in expected)
        assert status_for(exc) == expected[family], cls  # type: ignore[index]


BAD: list[tuple[str, str, Any, int, str]] = [
    ("post", "append", {"tokens": [999999]}, 400, "token_out_of_vocabulary"),
    ("post", "append", {"tokens": [1], "offset": 99}, 409, "offset_mismatch"),
    ("post", "append", {"tokens": [1], "offset": -1}, 400, "invalid_parameters"),
    (
        "post",
        "append",
        {"tokens": [1], "offset": -1, "truncating": True},
        400,
        "invalid_parameters",
    ),
    ("post", "append", {"tokens": "abc"}, 400, "invalid_parameters"),
    ("post", "append", {}, 400, "invalid_parameters"),
    ("post", "append", "not json", 400, "invalid_argument"),
    ("post", "generate", {"max_tokens": -1}, 400, "invalid_parameters"),
    ("post", "generate", {"top_p": 0}, 400, "invalid_parameters"),
    ("post", "generate", {"logprob_ranges": [[5, 1]]}, 400, "invalid_range"),
    ("post", "fork", {"at_position": 999}, 400, "invalid_range"),
    ("post", "fork", {"at_version": 999}, 400, "invalid_parameters"),
    ("post", "fork", {"protocol": "p" * 33}, 400, "invalid_parameters"),
    ("post", "fork", {"label": "l" * 1001}, 400, "invalid_parameters"),
    # a JSON body's integers are JSON integers: not strings of digits, booleans or 1.0
    ("post", "fork", {"at_position": "1"}, 400, "invalid_parameters"),
    ("post", "fork", {"at_position": True}, 400, "invalid_parameters"),
    ("post", "fork", {"at_position": 1.0}, 400, "invalid_parameters"),
    ("post", "fork", {"at_version": "2"}, 400, "invalid_parameters"),
    ("post", "append", {"tokens": [1], "offset": "3"}, 400, "invalid_parameters"),
    ("post", "generate", {"max_tokens": "2", "stream": False}, 400, "invalid_parameters"),
    ("post", "generate", {"top_k": "2", "stream": False}, 400, "invalid_parameters"),
    ("post", "generate", {"logprob_top_k": "2", "stream": False}, 400, "invalid_parameters"),
    ("get", "", {"version": "x"}, 400, "invalid_parameters"),
    ("get", "", {"version": 999}, 400, "invalid_parameters"),
    ("get", "events", {"patch": "json-merge"}, 400, "invalid_parameters"),
]


@pytest.mark.parametrize(
    ("method", "route", "body", "status", "code"), BAD, ids=[f"{b[1]}-{b[4]}" for b in BAD]
)
async def test_bad_input_is_a_typed_error_and_changes_nothing(
    client: httpx.AsyncClient, method: str, route: str, body: Any, status: int, code: str
) -> None:
    sid = await _open(client)
    await client.post(f"/v1/sessions/{sid}/append", json={"text": "abc"})
    before = await _export(client, sid)
    url = f"/v1/sessions/{sid}/{route}".rstrip("/")
    if method == "get":
        r = await client.get(url, params=body)
    elif isinstance(body, str):
        r = await client.post(url, content=body)
    else:
        r = await client.post(url, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code and r.json()["error"]["message"]
    assert await _export(client, sid) == before
    assert len((await client.get("/v1/sessions")).json()["sessions"]) == 1  # no fork leaked


async def test_fork_at_a_string_position_is_a_typed_error(client: httpx.AsyncClient) -> None:
    """``"at_position": "1"`` was once taken for 1; it names its field and the kind it got."""
    sid = await _open(client)
    await client.post(f"/v1/sessions/{sid}/append", json={"text": "abc"})
    for bad, kind in (("1", "a string ('1')"), (True, "a boolean (true)"), (1.0, "a number")):
        r = await client.post(f"/v1/sessions/{sid}/fork", json={"at_position": bad})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "invalid_parameters"
        assert error["message"].startswith(f"at_position must be a JSON integer, got {kind}")
    assert len((await client.get("/v1/sessions")).json()["sessions"]) == 1
    r = await client.post(f"/v1/sessions/{sid}/fork", json={"at_position": 1})
    assert r.status_code == 201 and r.json()["history"]["ids"] == list(b"a")


async def test_not_found_closed_and_routing_errors(client: httpx.AsyncClient) -> None:
    for path in (
        "/v1/sessions/s_nope",
        "/v1/sessions/s_nope/export",
        "/v1/sessions/s_nope/events",
        "/v1/sessions/s_nope/audit",
    ):
        r = await client.get(path)
        assert (r.status_code, r.json()["error"]["code"]) in (
            (404, "session_not_found"),
            (404, "not_found"),
        ), path
    r = await client.post("/v1/sessions/s_nope/append", json={"text": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    assert (await client.get("/v2/nothing")).json()["error"]["code"] == "not_found"
    r = await client.delete("/v1/sessions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    sid = await _open(client)
    await client.post(f"/v1/sessions/{sid}/close")
    before = await _export(client, sid)
    r = await client.post(f"/v1/sessions/{sid}/append", json={"text": "x"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "session_closed"
    assert await _export(client, sid) == before


async def test_context_overflow_is_413(sqlite_url: str) -> None:
    rt = await Runtime.create(make_config(sqlite_url), engine=ReferenceEngine(max_length=8))
    app = create_app(rt)
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t"
        ) as c:
            sid = await _open(c)
            r = await c.post(f"/v1/sessions/{sid}/append", json={"text": "far too long"})
            assert r.status_code == 413 and r.json()["error"]["code"] == "context_overflow"
            assert (await c.get(f"/v1/sessions/{sid}")).json()["history"]["ids"] == []
    finally:
        await app.state.api.aclose()
        await rt.aclose()


async def test_bearer_auth(sqlite_url: str) -> None:
    rt = await Runtime.create(make_config(sqlite_url), engine=ReferenceEngine())
    app = create_app(rt, auth_token="s3cret")
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t"
        ) as c:
            r = await c.post("/v1/sessions", json={})
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthenticated"
            assert r.headers["www-authenticate"].startswith("Bearer")
            r = await c.get("/v1/sessions", headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401
            assert (await c.get("/v1/sessions")).status_code == 401
            assert (
                await c.get("/v1/sessions", params={"access_token": "s3cret"})
            ).status_code == 200
            r = await c.post("/v1/sessions", json={}, headers={"Authorization": "Bearer s3cret"})
            assert r.status_code == 201
            assert (await c.get("/healthz")).status_code == 200
            assert (await c.get("/metrics")).status_code == 200
        assert len(await rt.log.list_sessions()) == 1
    finally:
        await app.state.api.aclose()
        await rt.aclose()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"protocol": "p" * 40}, "protocol must be at most 32 characters, got 40"),
        ({"label": "l" * 1001}, "label must be at most 1000 characters, got 1001"),
        ({"protocol": 7}, "protocol must be a string"),
        ({"label": ["x"]}, "label must be a string"),
    ],
)
async def test_create_checks_sizes_before_the_database(
    any_runtime: Runtime, body: dict[str, Any], message: str
) -> None:
    """On PostgreSQL a 40-character protocol would overflow its column: the API answers 400 first."""
    app = create_app(any_runtime)
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t"
        ) as c:
            r = await c.post("/v1/sessions", json=body)
            assert r.status_code == 400, r.text
            assert r.json()["error"] == {"code": "invalid_parameters", "message": message}
            assert (await c.get("/v1/sessions")).json()["sessions"] == []
            # the longest accepted values fit the sessions index
            sid = await _open(c, protocol="p" * 32, label="l" * 1000)
            row = await any_runtime.log.get_session(sid)
            assert (row.protocol, row.label) == ("p" * 32, "l" * 1000)
    finally:
        await app.state.api.aclose()


async def test_audit_reports_a_tampered_log(runtime: Runtime, client: httpx.AsyncClient) -> None:
    sid = await _open(client)
    await client.post(f"/v1/sessions/{sid}/append", json={"text": "abc"})
    tampered = '{"start":0,"tokens":[120,121,122],"images":[]}'
    await runtime.log.dialect.transaction(  # past the log's API, on its own connection
        lambda cur: cur.execute(
            "UPDATE events SET body = ? WHERE session_id = ? AND version = 2", (tampered, sid)
        ),
        None,
    )
    report = (await client.get(f"/v1/sessions/{sid}/audit")).json()
    assert report["session_id"] == sid and report["chain_ok"] is False and report["ok"] is False
    assert report["problems"]


async def test_images_are_served_from_the_blob_store_and_only_for_their_session(
    runtime: Runtime, client: httpx.AsyncClient
) -> None:
    big, small = b"\x89PNG" + bytes(range(256)) * 40, b"\x89PNG small"
    assert len(big) > runtime.log.inline_max_bytes >= len(small)
    block = [200] + [IMAGE_PAD] * 8 + [201]
    sid = await _open(client)
    await runtime.append_tokens(
        sid,
        [1, *block, 2, *block],
        images=[ImageIn(big, "image/png", 1, 11), ImageIn(small, "image/gif", 12, 22)],
    )
    other = await _open(client)
    for data, mime in ((big, "image/png"), (small, "image/gif")):
        sha = hashlib.sha256(data).hexdigest()
        r = await client.get(f"/v1/sessions/{sid}/images/{sha}")
        assert r.status_code == 200 and r.content == data and r.headers["content-type"] == mime
        r = await client.get(f"/v1/sessions/{other}/images/{sha}")  # another session's image
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    child = (await client.post(f"/v1/sessions/{sid}/fork", json={})).json()["id"]
    for data in (big, small):  # a fork shows its inherited images
        r = await client.get(f"/v1/sessions/{child}/images/{hashlib.sha256(data).hexdigest()}")
        assert r.status_code == 200 and r.content == data
    r = await client.get(f"/v1/sessions/{sid}/images/{'0' * 64}")
    assert r.status_code == 404
    r = await client.get(f"/v1/sessions/s_nope/images/{'0' * 64}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"


async def test_replay_steps_rebuild_the_document(client: httpx.AsyncClient) -> None:
    sid = await _open(client, label="replay")
    await client.post(f"/v1/sessions/{sid}/append", json={"text": "Hi é"})
    await client.post(
        f"/v1/sessions/{sid}/generate", json={"max_tokens": 5, "seed": 4, "stream": False}
    )
    await client.post(f"/v1/sessions/{sid}/fork", json={"at_position": 2})
    await client.post(f"/v1/sessions/{sid}/close")
    replay = (await client.get(f"/v1/sessions/{sid}/replay")).json()
    doc = replay["base"]
    assert doc["version"] == 0
    for step in replay["steps"]:
        doc = apply_patch(doc, step["patch"])
    assert doc == (await client.get(f"/v1/sessions/{sid}")).json()
    assert [s["type"] for s in replay["steps"]][-2:] == [
        "session.opened",
        "session.closed",
    ]  # the fork, then close
    assert replay["version"] == doc["version"]


async def test_forks_cost_one_index_query_per_document(
    runtime: Runtime, client: httpx.AsyncClient
) -> None:
    """A document lists its forks with one sessions-index query; a fork's first event is read once."""
    sid = await _open(client)
    await client.post(f"/v1/sessions/{sid}/append", json={"text": "abcdef"})
    forks = [(await runtime.fork(sid, at_position=i)).session_id for i in range(1, 6)]
    calls: Counter[str] = Counter()
    for name in ("read", "list_sessions"):
        real = getattr(runtime.log, name)

        def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            calls[_name] += 1
            return _real(*args, **kwargs)

        setattr(runtime.log, name, counted)
    first = (await client.get(f"/v1/sessions/{sid}")).json()
    assert sorted(c["session_id"] for c in first["children"]) == sorted(forks)
    assert calls == {
        "list_sessions": 1,
        "read": 1 + len(forks),
    }  # cold: each fork's first event once
    for _ in range(3):
        calls.clear()
        assert (await client.get(f"/v1/sessions/{sid}")).json() == first
        assert calls == {"list_sessions": 1, "read": 1}


async def test_a_fork_made_while_its_parent_generates_renders(server: Served) -> None:
    """The viewer's re-run on a live session: fork at an earlier generation while the parent still
    generates, then generate in the fork. The fork inherits the running generation and ends it
    (interrupted) in its own log first; its document, replay and live stream still render."""
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as c:
        sid = (await c.post("/v1/sessions", json={})).json()["id"]
        await c.post(f"/v1/sessions/{sid}/append", json={"text": "Hello"})
        first = (
            await c.post(
                f"/v1/sessions/{sid}/generate", json={"max_tokens": 4, "seed": 1, "stream": False}
            )
        ).json()["generation"]
        await c.post(
            f"/v1/sessions/{sid}/generate", json={"max_tokens": 1000, "seed": 2, "background": True}
        )
        child = (
            await c.post(f"/v1/sessions/{sid}/fork", json={"at_position": first["prompt_length"]})
        ).json()["id"]
        again = await c.post(
            f"/v1/sessions/{child}/generate", json={"max_tokens": 4, "seed": 1, "stream": False}
        )
        assert again.status_code == 200, again.text
        doc = await c.get(f"/v1/sessions/{child}")
        assert doc.status_code == 200, doc.text
        [gen] = doc.json()["generations"]
        assert [t["id"] for t in gen["tokens"]] == [t["id"] for t in first["tokens"]]
        replay = await c.get(f"/v1/sessions/{child}/replay")
        assert replay.status_code == 200, replay.text
        await c.post(f"/v1/sessions/{child}/close", json={})
        async with c.stream("GET", f"/v1/sessions/{child}/events") as r:
            text = (await r.aread()).decode()
        assert "event: snapshot" in text and "event: end" in text and "event: error" not in text
    assert server.runtime.generations.is_running(sid)  # the parent's generation ran on


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_a_json_generate_answers_the_documents_entry_for_its_generation(
    client: httpx.AsyncClient, seed: int
) -> None:
    """``stream: false`` answers the generation's entry made from its own events (no
    read of the history): the same entry the document holds, text, prefill scores,
    top logprobs and timing included, and the session's version after it."""
    sid = await _open(client)
    await client.post(f"/v1/sessions/{sid}/append", json={"text": "héllo wörld, "})
    for turn in range(3):
        r = await client.post(
            f"/v1/sessions/{sid}/generate",
            json={
                "text": "ünïcode ",
                "max_tokens": 6 + turn,
                "seed": seed,
                "stream": False,
                "logprob_top_k": 2,
                "logprob_ranges": [[0, 4]],
            },
        )
        assert r.status_code == 200, r.text
        answer = r.json()
        doc = (await client.get(f"/v1/sessions/{sid}")).json()
        assert answer["version"] == doc["version"]
        assert answer["generation"] == doc["generations"][turn]
        assert answer["generation"]["status"] == "finished"


@pytest.mark.parametrize(
    "prefer",
    ["return=minimal", "respond-async, return=minimal", 'RETURN = "minimal"; x=1'],
)
async def test_close_with_prefer_return_minimal_answers_id_status_version(
    client: httpx.AsyncClient, prefer: str
) -> None:
    """``Prefer: return=minimal`` (RFC 7240) on close answers the session's id, status and
    version, says it applied the preference, and closes exactly as without it; without
    it (or with ``return=representation``) the answer is the document."""
    sid = await _open(client)
    r = await client.post(f"/v1/sessions/{sid}/generate", json={"text": "hi", "max_tokens": 3})
    assert r.status_code == 200, r.text
    r = await client.post(f"/v1/sessions/{sid}/close", headers={"Prefer": prefer})
    assert r.status_code == 200, r.text
    assert r.headers["preference-applied"] == "return=minimal"
    doc = (await client.get(f"/v1/sessions/{sid}")).json()
    assert r.json() == {"id": sid, "status": "closed", "version": doc["version"]}
    assert doc["status"] == "closed"
    again = await client.post(
        f"/v1/sessions/{sid}/close", headers={"Prefer": "return=representation"}
    )
    assert again.status_code == 200 and "preference-applied" not in again.headers
    assert again.json() == doc
