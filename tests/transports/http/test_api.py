"""The JSON API over ASGI: routes, error mapping (every code -> status), data unchanged after bad input."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

import core.errors as E
from core.runtime import Runtime
from engines.reference import ReferenceEngine
from tests.conftest import make_config
from transports.sse.app import create_app
from transports.sse.errors import status_for


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
    r = await client.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 4, "seed": 1, "stream": False,
                                                                "logprob_top_k": 2})
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
    assert (await client.get("/v1/sessions", params={"parent": sid})).json()["sessions"][0]["id"] == child["id"]
    r = await client.post(f"/v1/sessions/{sid}/close")
    assert r.json()["status"] == "closed"
    closed = (await client.get("/v1/sessions", params={"status": "closed"})).json()["sessions"]
    assert [s["id"] for s in closed] == [sid]
    lines = await _export(client, sid)
    assert [ln["version"] for ln in lines] == list(range(1, len(lines) + 1))
    audit = (await client.get(f"/v1/sessions/{sid}/audit")).json()
    assert audit["chain"] == "verified" and audit["fold"] == "ok" and audit["events"] == len(lines)
    assert (await client.get(f"/v1/sessions/{child['id']}/audit")).json()["chain"] == "verified"


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
    expected = {E.NotFound: 404, E.InvalidArgument: 400, E.FailedPrecondition: 409, E.ContextOverflow: 413,
                E.ResourceExhausted: 429, E.Aborted: 409, E.Unauthenticated: 401, E.ChainBroken: 500, E.InvalidEvent: 500, E.LogClosed: 503,
                E.ConfigError: 500, E.EngineError: 502}
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
    ("post", "append", {"tokens": "abc"}, 400, "invalid_parameters"),
    ("post", "append", {}, 400, "invalid_parameters"),
    ("post", "append", "not json", 400, "invalid_argument"),
    ("post", "generate", {"max_tokens": -1}, 400, "invalid_parameters"),
    ("post", "generate", {"top_p": 0}, 400, "invalid_parameters"),
    ("post", "generate", {"logprob_ranges": [[5, 1]]}, 400, "invalid_range"),
    ("post", "fork", {"at_position": 999}, 400, "invalid_range"),
    ("post", "fork", {"at_version": 999}, 400, "invalid_parameters"),
    ("get", "", {"version": "x"}, 400, "invalid_parameters"),
    ("get", "", {"version": 999}, 400, "invalid_parameters"),
    ("get", "events", {"patch": "json-merge"}, 400, "invalid_parameters"),
]


@pytest.mark.parametrize(("method", "route", "body", "status", "code"), BAD, ids=[f"{b[1]}-{b[4]}" for b in BAD])
async def test_bad_input_is_a_typed_error_and_changes_nothing(
        client: httpx.AsyncClient, method: str, route: str, body: Any, status: int, code: str) -> None:
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


async def test_not_found_closed_and_routing_errors(client: httpx.AsyncClient) -> None:
    for path in ("/v1/sessions/s_nope", "/v1/sessions/s_nope/export", "/v1/sessions/s_nope/events",
                 "/v1/sessions/s_nope/audit"):
        r = await client.get(path)
        assert (r.status_code, r.json()["error"]["code"]) in ((404, "session_not_found"), (404, "not_found")), path
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
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
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
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            r = await c.post("/v1/sessions", json={})
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthenticated"
            assert r.headers["www-authenticate"].startswith("Bearer")
            r = await c.get("/v1/sessions", headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401
            assert (await c.get("/v1/sessions")).status_code == 401
            assert (await c.get("/v1/sessions", params={"access_token": "s3cret"})).status_code == 200
            r = await c.post("/v1/sessions", json={}, headers={"Authorization": "Bearer s3cret"})
            assert r.status_code == 201
            assert (await c.get("/healthz")).status_code == 200
            assert (await c.get("/metrics")).status_code == 200
        assert len(await rt.log.list_sessions()) == 1
    finally:
        await app.state.api.aclose()
        await rt.aclose()
