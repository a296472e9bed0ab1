"""The OpenAPI document is complete: every route the app serves is in it (and nothing else is), it is
a valid OpenAPI 3.1 document, and what the native routes answer is what it says they answer.

Generic over the app's routing table, so routes added later (the OpenAI-compatible ones, or any
other) fail here until they are described in transports/sse/openapi.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import Iterator

import httpx
from openapi_spec_validator import validate
from starlette.routing import BaseRoute, Mount, Route

from core.nodes import FragmentIn
from core.runtime import Runtime
from core.tokens import ImageIn
from engines.reference import IMAGE_PAD
from tests.transports.http.conftest import Served
from transports.sse.app import create_app
from transports.sse.openapi import spec

_CONVERTER = re.compile(r"\{(\w+)(?::\w+)?\}")


def served(routes: list[BaseRoute], prefix: str = "") -> Iterator[tuple[str, str]]:
    """(OpenAPI path template, lower-case method) for every route in a Starlette routing table."""
    for r in routes:
        if isinstance(r, Route):
            for m in sorted((r.methods or {"GET"}) - {"HEAD"}):
                yield _CONVERTER.sub(r"{\1}", prefix + r.path), m.lower()
        elif isinstance(r, Mount) and r.routes:
            yield from served(list(r.routes), prefix + r.path)
        elif isinstance(r, Mount):  # an ASGI app such as StaticFiles: everything under it
            yield prefix + r.path + "/{path}", "get"
        else:
            raise AssertionError(f"a route of a kind this test does not know: {r!r}")


def documented(doc: dict[str, object]) -> set[tuple[str, str]]:
    paths = doc["paths"]
    assert isinstance(paths, dict)
    return {
        (p, m)
        for p, ops in paths.items()
        for m in ops
        if m in ("get", "post", "put", "patch", "delete")
    }


async def test_every_served_route_is_documented_and_nothing_else(runtime: Runtime) -> None:
    app = create_app(runtime)
    try:
        routes = set(served(list(app.routes)))
    finally:
        await app.state.api.aclose()
    doc = spec()
    validate(doc)  # type: ignore[arg-type]
    assert not routes - documented(doc), "served but not in openapi.py"
    assert not documented(doc) - routes, "in openapi.py but not served"
    for p, m in routes:
        op = doc["paths"][p][m]  # type: ignore[index]
        names = {x["name"] for x in op.get("parameters", []) if x["in"] == "path"}
        assert names == set(re.findall(r"\{(\w+)\}", p)), (p, m, "path parameters")


async def test_answers_are_what_the_document_says(server: Served) -> None:
    """Each native route, driven once over loopback: its status and content type are documented."""
    async with httpx.AsyncClient(base_url=server.url, timeout=20) as c:
        await _drive(server.runtime, c)


async def _drive(runtime: Runtime, c: httpx.AsyncClient) -> None:
    doc = spec()
    seen: list[tuple[str, str, int, str]] = []

    def template(path: str) -> str:
        for p in doc["paths"]:
            if re.fullmatch(re.sub(r"\\\{\w+\\\}", "[^/]+", re.escape(p)), path):
                return p
        raise AssertionError(f"{path} matches no documented path")

    async def record(r: httpx.Response) -> None:
        if r.request.url.path == "/v1/sessions/events":
            return  # endless: recorded by hand below
        await r.aread()
        seen.append(
            (
                template(r.request.url.path),
                r.request.method.lower(),
                r.status_code,
                r.headers.get("content-type", "").split(";")[0],
            )
        )

    c.event_hooks["response"].append(record)
    sid = (await c.post("/v1/sessions", json={"label": "spec"})).json()["id"]
    await c.get("/v1/sessions")
    await c.post(f"/v1/sessions/{sid}/append", json={"text": "Hi"})
    await c.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 2, "seed": 1, "stream": False})
    await c.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 2, "seed": 2})
    await c.post(
        f"/v1/sessions/{sid}/generate", json={"max_tokens": 2, "seed": 3, "background": True}
    )
    for _ in range(500):
        if not runtime.is_generating(sid):
            break
        await asyncio.sleep(0.01)
    await c.get(f"/v1/sessions/{sid}")
    await c.get("/v1/sessions/s_nope")
    await c.post(f"/v1/sessions/{sid}/feedback", json={"score": 1})
    child = (await c.post(f"/v1/sessions/{sid}/fork", json={"at_position": 1})).json()["id"]
    await c.get(f"/v1/sessions/{sid}/export")
    await c.get(f"/v1/sessions/{sid}/audit")
    await c.get(f"/v1/sessions/{child}/replay")
    await c.post(f"/v1/sessions/{child}/close", json={})
    async with c.stream("GET", f"/v1/sessions/{child}/events") as r:  # closed: snapshot, then end
        await r.aread()
    async with c.stream("GET", "/v1/sessions/events") as r:  # endless: its head is enough
        seen.append(
            ("/v1/sessions/events", "get", r.status_code, r.headers["content-type"].split(";")[0])
        )
        await asyncio.wait_for(anext(r.aiter_bytes()), 10)
    data = b"\x89PNG" + bytes(range(256)) * 40
    im = (await runtime.open_session("salience")).session_id
    await runtime.append_tokens(
        im, [200] + [IMAGE_PAD] * 8 + [201], images=[ImageIn(data, "image/png", 0, 10)]
    )
    await c.get(f"/v1/sessions/{im}/images/{hashlib.sha256(data).hexdigest()}")
    ev = (await runtime.open_session("evergreen")).session_id
    await runtime.append_fragments(
        ev, [FragmentIn(id="n", has_chunk=True, data=b"hello", metadata={"mimetype": "text/plain"})]
    )
    await c.get(f"/v1/sessions/{ev}/nodes/n/content")
    for path in ("/", "/healthz", "/metrics", "/openapi.json", "/static/app.js"):
        await c.get(path)

    for p, m, status, ctype in seen:
        responses = doc["paths"][p][m]["responses"]  # type: ignore[index]
        entry = responses.get(str(status)) or responses.get(f"{str(status)[0]}XX")
        assert entry is not None, (p, m, status, "status not documented")
        content = entry.get("content")
        if content:
            ok = any(
                t == ctype or (t.endswith("/*") and ctype.startswith(t[:-1])) or t == "*/*"
                for t in content
            )
            assert ok, (p, m, status, ctype, sorted(content))
    got = {(p, m, s, t) for p, m, s, t in seen}
    assert ("/v1/sessions/{sid}/generate", "post", 200, "application/json") in got
    assert ("/v1/sessions/{sid}/generate", "post", 200, "text/event-stream") in got
    assert ("/v1/sessions/{sid}/export", "get", 200, "application/x-ndjson") in got
    assert ("/v1/sessions/{sid}/images/{sha}", "get", 200, "image/png") in got
    assert ("/v1/sessions/{sid}/nodes/{nid}/content", "get", 200, "text/plain") in got
    native = {(p, m) for p, m in documented(doc) if not doc["paths"][p][m].get("tags")}  # type: ignore[index]
    assert native <= {(p, m) for p, m, _, _ in seen}, "a native route this test never drove"


#: how to make each native route answer 400 (a body that is not JSON does it for every POST)
BAD_QUERY = {
    "/v1/sessions": "?limit=0",
    "/v1/sessions/events": "?patch=zz",
    "/v1/sessions/{sid}": "?version=abc",
    "/v1/sessions/{sid}/events": "?patch=zz",
}
#: a valid body per POST route ({} where that is one); 409 is the same request on a closed session
VALID_BODY = {
    "/v1/sessions/{sid}/append": {"text": "x"},
    "/v1/sessions/{sid}/generate": {"max_tokens": 1, "stream": False},
    "/v1/sessions/{sid}/feedback": {"score": 1},
}
ON_CLOSED = ("/v1/sessions/{sid}/append", "/v1/sessions/{sid}/generate")


async def test_every_documented_error_is_answered(runtime: Runtime) -> None:
    """Each 4xx the document lists for a native route, produced: 401 without the token, 404 for an unknown
    session, 400 for a bad body or query, 409 on a closed session."""
    doc = spec()
    app = create_app(runtime, auth_token="t0k")
    auth = {"authorization": "Bearer t0k"}
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=20
        ) as c:
            sid = (await c.post("/v1/sessions", json={}, headers=auth)).json()["id"]
            await c.post(f"/v1/sessions/{sid}/append", json={"text": "Hi"}, headers=auth)
            await c.post(f"/v1/sessions/{sid}/close", json={}, headers=auth)
            produced = 0
            for path, ops in doc["paths"].items():
                for method, op in ops.items():
                    if op.get(
                        "tags"
                    ):  # the OpenAI-compatible routes answer in OpenAI's shape, tested with them
                        continue
                    for status in sorted(k for k in op["responses"] if k.startswith("4")):
                        real = (
                            path.replace("{sid}", sid)
                            .replace("{sha}", "0" * 64)
                            .replace("{nid}", "nope")
                        )
                        real = real.replace("{path}", "app.js")
                        body = (
                            json.dumps(VALID_BODY.get(path, {})).encode()
                            if method == "post"
                            else None
                        )
                        headers = dict(auth)
                        if status == "401":
                            headers = {}
                        elif status == "404":
                            real = (
                                real.replace(sid, "s_nope") if "{sid}" in path else real + "/nope"
                            )
                        elif status == "400":
                            if method == "post":
                                body = b"{not json"
                            else:
                                assert path in BAD_QUERY, f"no recipe for a 400 from GET {path}"
                                real += BAD_QUERY[path]
                        elif status == "409":
                            assert path in ON_CLOSED, f"no recipe for a 409 from {method} {path}"
                        r = await c.request(
                            method.upper(),
                            real,
                            content=body,
                            headers={
                                **headers,
                                **(
                                    {"content-type": "application/json"} if body is not None else {}
                                ),
                            },
                        )
                        assert r.status_code == int(status), (
                            method,
                            path,
                            status,
                            r.status_code,
                            r.text[:200],
                        )
                        assert r.headers["content-type"].startswith("application/json")
                        assert set(r.json()["error"]) >= {"code", "message"}
                        produced += 1
            assert produced >= 40
    finally:
        await app.state.api.aclose()
