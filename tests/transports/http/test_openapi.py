"""The OpenAPI document is complete: every route the app serves is in it (and nothing else is), it is
a valid OpenAPI 3.1 document, and what the native routes answer is what it says they answer.

Generic over the app's routing table, so routes added later (the OpenAI-compatible ones, or any
other) fail here until they are described in transports/http/server/openapi.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import httpx
import pytest
from openapi_schema_validator import OAS31Validator
from openapi_spec_validator import validate
from starlette.routing import BaseRoute, Mount, Route

from sessiontape.core.nodes import FragmentIn
from sessiontape.core.runtime import Runtime
from sessiontape.core.tokens import ImageIn
from sessiontape.engines.reference import IMAGE_PAD, ReferenceEngine
from sessiontape.transports.http.openai import schema as openai_schema
from sessiontape.transports.http.plugin import HttpTransport
from sessiontape.transports.http.server.app import create_app
from sessiontape.transports.http.server.openapi import spec
from tests.helpers.config import make_config
from tests.helpers.http import Served

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
        if not runtime.generations.is_running(sid):
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
    await runtime.nodes.append_fragments(
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


# -- the OpenAI-compatible routes --------------------------------------------------------------

TOKEN = "t0k"
MODEL = "reference-bigram-v1"


class Flaky(ReferenceEngine):
    """The reference engine, except that a generation whose prompt holds ``FAIL`` raises after its
    first step (an engine failure, recorded as ``error``), and one whose prompt holds ``END`` ends
    at once (EOS: a completed response)."""

    def logits(self, history: Sequence[int], position: int) -> Any:
        out = super().logits(history, position)
        if "END" in self.detokenize(list(history[:position])):
            out[self.info.eos_token_ids[0]] += 100.0
        return out

    async def generate(self, *a: Any, **k: Any) -> AsyncIterator[Any]:  # type: ignore[override]
        history = a[1] if len(a) > 1 else k.get("history", ())
        fail = "FAIL" in self.detokenize(list(history))
        async for step in super().generate(*a, **k):
            yield step
            if fail:
                raise RuntimeError("the engine fell over")


@pytest.fixture
async def openai_server(sqlite_url: str, port: int) -> AsyncIterator[Served]:
    cfg = make_config(sqlite_url, auth={"token": TOKEN})
    rt = await Runtime.create(cfg, engine=Flaky(step_delay_s=0.02))
    tr = HttpTransport(rt, {"listen": f"127.0.0.1:{port}", "heartbeat_s": 1.0}, cfg)
    await tr.start()
    try:
        yield Served(rt, tr, f"http://127.0.0.1:{port}")
    finally:
        await tr.stop(grace=1.0)
        await rt.aclose()


def _sse_data(text: str) -> list[tuple[str, str]]:
    """(event name, data) of each event of a Server-Sent Events body."""
    out = []
    for block in text.split("\n\n"):
        event, data = "message", []
        for line in block.splitlines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
        if data:
            out.append((event, "\n".join(data)))
    return out


class Checker:
    """Checks each answer of an OpenAI route against the document: status, content type, and the
    body (or each streamed event) against the schema documented for it."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc
        self.produced: set[tuple[str, str, str]] = set()
        self.events: set[str] = set()

    def schema(self, node: dict[str, Any]) -> OAS31Validator:
        return OAS31Validator({**node, "components": self.doc["components"]})

    def template(self, path: str) -> str:
        for p in self.doc["paths"]:
            if re.fullmatch(re.sub(r"\\\{\w+\\\}", "[^/]+", re.escape(p)), path):
                return str(p)
        raise AssertionError(f"{path} matches no documented path")

    def __call__(self, r: httpx.Response) -> Any:
        path, method = self.template(r.request.url.path), r.request.method.lower()
        responses = self.doc["paths"][path][method]["responses"]
        key = str(r.status_code) if str(r.status_code) in responses else f"{r.status_code // 100}XX"
        assert key in responses, (path, method, r.status_code, "status not documented", r.text)
        ctype = r.headers["content-type"].split(";")[0]
        media = responses[key]["content"].get(ctype)
        assert media is not None, (path, method, r.status_code, ctype, "content type")
        self.produced.add((path, method, key))
        if ctype == "application/json":
            body = r.json()
            self.schema(media["schema"]).validate(body)
            return body
        assert ctype == "text/event-stream"
        out = []
        for event, data in _sse_data(r.text):
            if data == "[DONE]":
                continue
            value = json.loads(data)
            is_error = event == "error" or "error" in value
            self.schema(media["x-sse-error" if is_error else "x-sse-data"]).validate(value)
            if event != "message":
                assert value["type"] == event, (event, value)
            self.events.add(event if event != "message" else value.get("object", "error"))
            out.append(value)
        return out


async def test_openai_answers_match_their_schemas(openai_server: Served) -> None:
    """Each OpenAI-compatible route, driven over loopback: every answer (each streamed event too) is
    valid against the schema the document gives it, and every status the document lists for these
    routes is produced here."""
    doc = spec()
    check = Checker(doc)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    rt = openai_server.runtime
    async with httpx.AsyncClient(base_url=openai_server.url, headers=auth, timeout=30) as c:
        # models
        check(await c.get("/v1/models"))
        check(await c.get(f"/v1/models/{MODEL}"))
        check(await c.get("/v1/models/gpt-4o"))
        # responses: plain, with logprobs and instructions, streamed
        r = check(
            await c.post(
                "/v1/responses",
                json={
                    "model": MODEL,
                    "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
                    "instructions": "Be brief.",
                    "max_output_tokens": 4,
                    "seed": 3,
                    "metadata": {"k": "v"},
                    "include": ["message.output_text.logprobs"],
                    "top_logprobs": 2,
                },
            )
        )
        assert r["output"][0]["content"][0]["logprobs"]
        check(
            await c.post(
                "/v1/responses",
                json={"model": MODEL, "input": "s", "stream": True, "max_output_tokens": 3},
            )
        )
        done = check(
            await c.post("/v1/responses", json={"model": MODEL, "input": "END", "stream": True})
        )
        assert done[-1]["type"] == "response.completed"
        check(await c.get(f"/v1/responses/{r['id']}"))
        check(await c.get(f"/v1/responses/{r['id']}?stream=true&starting_after=2"))
        check(await c.get(f"/v1/responses/{r['id']}/input_items?order=asc&limit=1"))
        # a background response: continuing it while it runs is 409; cancel it
        bg = check(
            await c.post(
                "/v1/responses",
                json={
                    "model": MODEL,
                    "input": "long",
                    "background": True,
                    "max_output_tokens": 400,
                },
            )
        )
        busy = await c.post(
            "/v1/responses",
            json={"model": MODEL, "input": "x", "previous_response_id": bg["id"]},
        )
        assert busy.status_code == 409 and check(busy)["error"]["code"] == "session_busy"
        assert check(await c.post(f"/v1/responses/{bg['id']}/cancel"))["status"] == "cancelled"
        # a response whose generation failed: status failed, its stream ends with response.failed
        failed = check(await c.post("/v1/responses", json={"model": MODEL, "input": "FAIL"}))
        assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
        check(await c.get(f"/v1/responses/{failed['id']}?stream=true"))
        # chat completions: plain with logprobs, streamed with usage, and a failing engine
        chat = check(
            await c.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": [
                        {"role": "system", "content": "s"},
                        {"role": "user", "content": "Hi"},
                    ],
                    "max_tokens": 3,
                    "logprobs": True,
                    "top_logprobs": 1,
                    "stop": ["\n\n"],
                },
            )
        )
        chunks = check(
            await c.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "More"}],
                    "max_completion_tokens": 3,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                    "logprobs": True,
                    "session_id": chat["session_id"],
                },
            )
        )
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
        boom = await c.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "FAIL"}]},
        )
        assert boom.status_code >= 500 and check(boom)["error"]["type"] == "server_error"
        streamed_boom = check(
            await c.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "FAIL"}],
                    "stream": True,
                },
            )
        )
        assert "error" in streamed_boom[-1]
        await rt.close(chat["session_id"])
        closed = await c.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "session_id": chat["session_id"],
            },
        )
        assert closed.status_code == 409 and check(closed)["error"]["code"] == "session_closed"

        # the errors of each route: 400 (a bad field or query), 404 (an unknown id or model)
        chat_msg = [{"role": "user", "content": "x"}]
        for method, url, body in [
            ("POST", "/v1/responses", {"model": MODEL, "input": "x", "temperature": 3}),
            ("POST", "/v1/responses", {"model": "gpt-4o", "input": "x"}),
            ("GET", f"/v1/responses/{r['id']}?stream=true&starting_after=abc", None),
            ("GET", "/v1/responses/resp_s_nope_3", None),
            ("POST", f"/v1/responses/{r['id']}/cancel", None),  # not a background response
            ("POST", "/v1/responses/resp_s_nope_3/cancel", None),
            ("GET", f"/v1/responses/{r['id']}/input_items?limit=0", None),
            ("GET", "/v1/responses/resp_s_nope_3/input_items", None),
            ("POST", "/v1/chat/completions", {"model": MODEL, "messages": chat_msg, "n": 2}),
            ("POST", "/v1/chat/completions", {"model": "gpt-4o", "messages": chat_msg}),
        ]:
            answer = await c.request(method, url, json=body)
            assert answer.status_code in (400, 404), (method, url, answer.status_code)
            check(answer)
        # 401: every route, without the token
        for (path, method), _ in openai_schema.ERRORS_OF.items():
            real = path.replace("{model}", MODEL).replace("{rid}", r["id"])
            answer = await c.request(method.upper(), real, headers={"Authorization": "Bearer no"})
            assert answer.status_code == 401
            assert check(answer)["error"]["type"] == "authentication_error"

    assert check.events >= {
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
        "response.incomplete",
        "response.failed",
        "chat.completion.chunk",
    }, check.events
    documented = {
        (p, m, s)
        for p, ops in doc["paths"].items()
        for m, op in ops.items()
        if op.get("tags") == ["openai"]
        for s in op["responses"]
    }
    assert documented - check.produced == set(), "documented but never answered"
