"""Hostile HTTP input: each class of it is a typed 4xx that changes nothing, never a 500.

The in-process client covers parsing; a real uvicorn on loopback covers the
body limit while it streams in, slow headers, slow bodies and clients that
vanish mid-body.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from prometheus_client import generate_latest
from starlette.routing import Route

from sessiontape.core.generation.request import GenerateRequest
from sessiontape.core.runtime import Runtime
from sessiontape.engines.reference import ReferenceEngine
from sessiontape.transports.http.plugin import HttpTransport
from sessiontape.transports.http.server.app import create_app
from sessiontape.transports.http.server.inputs import Limits
from tests.helpers.config import make_config
from tests.helpers.http import Served


async def _open(client: httpx.AsyncClient, **body: Any) -> str:
    r = await client.post("/v1/sessions", json=body)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


async def _export(client: httpx.AsyncClient, sid: str) -> bytes:
    r = await client.get(f"/v1/sessions/{sid}/export")
    assert r.status_code == 200
    return r.content


@pytest.fixture
async def small(runtime: Runtime) -> AsyncIterator[httpx.AsyncClient]:
    """The app with small limits, so size refusals are cheap to provoke."""
    app = create_app(
        runtime, limits=Limits(max_body_bytes=4096, max_json_depth=8, max_meta_bytes=256)
    )
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test"
    ) as c:
        yield c
    await app.state.api.aclose()


#: (method, route under the session, raw body or query, expected status, expected code)
HOSTILE: list[tuple[str, str, Any, int, str]] = [
    # numbers: non-ASCII digits, signs, beyond 64 bits, Python's int-string limit
    ("get", "", {"version": "\u00b2"}, 400, "invalid_parameters"),
    ("get", "", {"version": "\u0663"}, 400, "invalid_parameters"),
    ("get", "", {"version": "--1"}, 400, "invalid_parameters"),
    ("get", "", {"version": "0"}, 400, "invalid_parameters"),
    ("get", "", {"version": "-3"}, 400, "invalid_parameters"),
    ("get", "", {"version": "9" * 30}, 400, "invalid_parameters"),
    ("get", "events", {"last_event_id": "9" * 5000}, 400, "invalid_parameters"),
    ("get", "events", {"last_event_id": "-1"}, 400, "invalid_parameters"),
    ("post", "append", b'{"tokens": [1], "offset": 18446744073709551616}', 400, "invalid_argument"),
    (
        "post",
        "append",
        b'{"tokens": [1], "offset": 9223372036854775808}',
        400,
        "invalid_parameters",
    ),
    ("post", "append", b'{"tokens": [' + b"9" * 5000 + b"]}", 400, "invalid_argument"),
    ("post", "append", b'{"tokens": [1], "offset": 1.5}', 400, "invalid_parameters"),
    # non-finite numbers, in any spelling
    ("post", "generate", b'{"temperature": NaN, "stream": false}', 400, "invalid_argument"),
    ("post", "generate", b'{"temperature": Infinity, "stream": false}', 400, "invalid_argument"),
    ("post", "generate", b'{"temperature": 1e400, "stream": false}', 400, "invalid_argument"),
    ("post", "generate", {"temperature": "nan", "stream": False}, 400, "invalid_parameters"),
    ("post", "generate", {"top_p": 1.5, "stream": False}, 400, "invalid_parameters"),
    ("post", "generate", {"top_k": -1, "stream": False}, 400, "invalid_parameters"),
    ("post", "generate", {"max_tokens": 2**31 + 1, "stream": False}, 400, "invalid_parameters"),
    ("post", "generate", {"max_tokens": "\u0665", "stream": False}, 400, "invalid_parameters"),
    ("post", "generate", {"seed": "\uff11\uff12", "stream": False}, 400, "invalid_parameters"),
    ("post", "generate", {"seed": 2**64, "stream": False}, 400, "invalid_argument"),
    ("post", "generate", {"stream": "no"}, 400, "invalid_parameters"),
    ("post", "feedback", b'{"score": NaN}', 400, "invalid_argument"),
    ("post", "feedback", b'{"score": -Infinity}', 400, "invalid_argument"),
    ("post", "feedback", b'{"score": 123456789012345678901234567890}', 400, "invalid_argument"),
    # Unicode: lone surrogates, invalid UTF-8
    ("post", "append", b'{"text": "a\\ud800b"}', 400, "invalid_argument"),
    ("post", "feedback", b'{"\\udfff": 1}', 400, "invalid_argument"),
    ("post", "close", b'{"reason": "\\ud800"}', 400, "invalid_argument"),
    ("post", "append", b'{"text": "\xff\xfe"}', 400, "invalid_argument"),
    # structure: depth, non-objects, unknown fields
    ("post", "feedback", b'{"a":' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "invalid_argument"),
    ("post", "feedback", b"[1]", 400, "invalid_argument"),
    ("post", "append", {"text": "x", "offest": 3}, 400, "unknown_field"),
    ("post", "generate", {"temprature": 0.5}, 400, "unknown_field"),
    ("post", "close", {"reason": "x", "force": True}, 400, "unknown_field"),
    ("post", "fork", {"at": 1}, 400, "unknown_field"),
    # values that used to change data instead of being refused
    ("post", "close", {"reason": None}, 200, ""),
    ("post", "close", {"reason": 5}, 400, "invalid_parameters"),
    ("post", "close", {"reason": {"x": 1}}, 400, "invalid_parameters"),
    ("post", "append", {"text": "more", "offset": 99}, 409, "offset_mismatch"),
    ("post", "append", {"text": "more", "truncating": "yes"}, 400, "invalid_parameters"),
    ("post", "fork", {"at_version": 0}, 400, "invalid_parameters"),
]


@pytest.mark.parametrize(
    ("method", "route", "body", "status", "code"),
    HOSTILE,
    ids=[f"{i}-{h[1] or 'get'}-{h[4] or h[3]}" for i, h in enumerate(HOSTILE)],
)
async def test_hostile_value_is_a_typed_error_and_changes_nothing(
    client: httpx.AsyncClient, method: str, route: str, body: Any, status: int, code: str
) -> None:
    sid = await _open(client)
    assert (
        await client.post(f"/v1/sessions/{sid}/append", json={"text": "abc"})
    ).status_code == 200
    before = await _export(client, sid)
    url = f"/v1/sessions/{sid}/{route}".rstrip("/")
    if method == "get":
        r = await client.get(url, params=body)
    elif isinstance(body, bytes):
        r = await client.post(url, content=body, headers={"content-type": "application/json"})
    else:
        r = await client.post(url, json=body)
    assert r.status_code == status, r.text
    if status >= 400:
        assert r.json()["error"]["code"] == code, r.text
        assert await _export(client, sid) == before


async def test_unknown_fields_are_named(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/sessions", json={"protocol": "http", "ttl": 5, "metadata": {}})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "unknown_field" and err["fields"] == ["metadata", "ttl"]
    assert "'metadata'" in err["message"] and "ttl_s" in err["message"]


async def test_offset_with_text_is_honoured(client: httpx.AsyncClient) -> None:
    sid = await _open(client, mode="offset")
    length = (await client.post(f"/v1/sessions/{sid}/append", json={"text": "abc"})).json()[
        "length"
    ]
    r = await client.post(f"/v1/sessions/{sid}/append", json={"text": "d", "offset": length})
    assert r.status_code == 200 and r.json()["length"] == length + 1
    r = await client.post(
        f"/v1/sessions/{sid}/append", json={"text": "x", "offset": 1, "truncating": True}
    )
    assert r.status_code == 200 and r.json()["length"] == 2


async def test_close_reason_is_stored_as_given(client: httpx.AsyncClient) -> None:
    sid = await _open(client)
    assert (
        await client.post(f"/v1/sessions/{sid}/close", json={"reason": "done"})
    ).status_code == 200
    lines = (await _export(client, sid)).decode().splitlines()
    assert '"reason":"done"' in lines[-1]


@pytest.mark.parametrize(
    "body",
    [
        {"ttl_s": float("inf")},
        {"ttl_s": 0},
        {"ttl_s": -1},
        {"ttl_s": 1e12},
        {"ttl_s": "60"},
        {"ttl_s": True},
        {"meta": {"n": 2**70}},
        {"eos_token_ids": [-1]},
        {"mode": 7},
        {"protocol": "\ud800"},
    ],
)
async def test_create_refuses_bad_values_and_stores_nothing(
    client: httpx.AsyncClient, body: dict[str, Any], runtime: Runtime
) -> None:
    before = await runtime.log.last_position()
    r = await client.post(
        "/v1/sessions", content=_dumps(body), headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, r.text
    assert await runtime.log.last_position() == before


def _dumps(value: Any) -> bytes:
    """JSON as an attacker writes it: big ints, lone surrogates and Infinity pass through."""
    import json

    return json.dumps(value, ensure_ascii=True).encode()


async def test_size_limits_are_413(small: httpx.AsyncClient, runtime: Runtime) -> None:
    sid = await _open(small)
    before = await _export(small, sid)
    r = await small.post(f"/v1/sessions/{sid}/feedback", json={"note": "x" * 5000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
    r = await small.post(f"/v1/sessions/{sid}/feedback", json={"note": "x" * 300})
    assert r.status_code == 413 and "feedback" in r.json()["error"]["message"]
    r = await small.post("/v1/sessions", json={"meta": {"note": "x" * 300}})
    assert r.status_code == 413
    r = await small.post(
        f"/v1/sessions/{sid}/feedback", content=b'{"a":' + b"[" * 9 + b"]" * 9 + b"}"
    )
    assert r.status_code == 400 and "nested" in r.json()["error"]["message"]
    assert await _export(small, sid) == before


async def test_unexpected_error_is_one_log_line_and_a_500_without_its_text(
    runtime: Runtime, caplog: pytest.LogCaptureFixture
) -> None:
    app = create_app(runtime)

    async def boom(_: Any) -> Any:
        raise RuntimeError("SELECT secret FROM events")

    app.router.routes.insert(0, Route("/boom", boom))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app, raise_app_exceptions=True), base_url="http://test"
    ) as c:
        with caplog.at_level(logging.DEBUG, logger="sessiontape.http"):
            r = await c.get("/boom")
    await app.state.api.aclose()
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["code"] == "internal" and "SELECT" not in r.text and "RuntimeError" not in r.text
    rid = err["request_id"]
    assert r.headers["x-request-id"] == rid
    lines = [rec for rec in caplog.records if rec.name == "sessiontape.http"]
    assert len(lines) == 1 and rid in lines[0].getMessage() and "boom" in lines[0].getMessage()


async def test_metrics_protocol_label_is_a_closed_set(client: httpx.AsyncClient) -> None:
    await _open(client, protocol="attacker-chosen-1")
    await _open(client, protocol="attacker-chosen-2")
    text = generate_latest().decode()
    assert "attacker-chosen" not in text
    assert 'sessiontape_sessions_opened_total{protocol="other"}' in text


# -- a real server: limits while the body streams in, slow clients -------------------


@pytest.fixture
async def served(sqlite_url: str, port: int) -> AsyncIterator[Served]:
    cfg = make_config(sqlite_url, limits={"header_timeout_s": 1.0, "body_timeout_s": 1.0})
    rt = await Runtime.create(cfg, engine=ReferenceEngine())
    tr = HttpTransport(rt, {"listen": f"127.0.0.1:{port}"}, cfg)
    await tr.start()
    try:
        yield Served(rt, tr, f"http://127.0.0.1:{port}")
    finally:
        await tr.stop(grace=1.0)
        await rt.aclose()


async def _health_latencies(url: str, stop: asyncio.Event) -> list[float]:
    out: list[float] = []
    async with httpx.AsyncClient(base_url=url) as c:
        while not stop.is_set() or not out:
            t0 = time.perf_counter()
            r = await c.get("/healthz")
            assert r.status_code == 200
            out.append(time.perf_counter() - t0)
            await asyncio.sleep(0.02)
    return out


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()


async def _response_head(reader: asyncio.StreamReader) -> bytes:
    return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)


async def test_100mb_body_is_refused_while_health_answers(served: Served) -> None:
    """100 MB, chunked (no Content-Length): refused with 413 once past the 16 MiB default, mid-stream;
    a concurrent /healthz keeps answering."""
    host, port = served.url.removeprefix("http://").split(":")
    async with httpx.AsyncClient(base_url=served.url) as c:
        sid = (await c.post("/v1/sessions", json={})).json()["id"]
    before = [e.to_json() for e in await served.runtime.log.read(sid)]
    stop = asyncio.Event()
    health = asyncio.create_task(_health_latencies(served.url, stop))
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        f"POST /v1/sessions/{sid}/feedback HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n".encode()
    )
    chunk = b'{"a":"' + b"x" * (1 << 20)
    sent = 0
    head = asyncio.create_task(_response_head(reader))
    with contextlib.suppress(ConnectionError):
        while sent < 100 * (1 << 20) and not head.done():
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await writer.drain()
            sent += len(chunk)
            chunk = b"x" * (1 << 20)
    status = (await head).split(b"\r\n", 1)[0]
    stop.set()
    latencies = await health
    await _close(writer)
    assert status.startswith(b"HTTP/1.1 413 ")
    assert sent < 100 * (1 << 20)  # refused while it streamed, not after reading it all
    assert max(latencies) < 5.0, latencies  # generous: the point is that it answered at all
    print(
        f"\nhealth during 100 MB body: n={len(latencies)} max={max(latencies) * 1000:.1f} ms "
        f"(body refused after {sent >> 20} MiB)"
    )
    assert [e.to_json() for e in await served.runtime.log.read(sid)] == before


async def test_declared_oversize_body_is_refused_before_it_is_read(served: Served) -> None:
    host, port = served.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Length: 104857600\r\n\r\n{")
    await writer.drain()
    head = await _response_head(reader)
    await _close(writer)
    assert head.startswith(b"HTTP/1.1 413")


async def test_slow_headers_are_cut_off_while_others_are_served(served: Served) -> None:
    """Slowloris: one header byte every 0.2 s never completes the headers; the 1 s header deadline
    closes the connection while /healthz keeps answering."""
    host, port = served.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 100

    async def trickle() -> int:
        sent = 0
        with contextlib.suppress(ConnectionError):
            for byte in request:
                writer.write(bytes([byte]))
                await writer.drain()
                sent += 1
                await asyncio.sleep(0.2)
        return sent

    sender = asyncio.create_task(trickle())
    async with httpx.AsyncClient(base_url=served.url) as c:
        assert (await c.get("/healthz")).status_code == 200
    assert (
        await asyncio.wait_for(reader.read(), 20) == b""
    )  # the server closed it, with no response
    sender.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await sender
    await _close(writer)


async def test_a_request_head_past_max_header_bytes_is_400_and_one_within_it_is_served(
    sqlite_url: str, port: int
) -> None:
    """``[limits] max_header_bytes`` bounds the request line and headers: a head just within
    it is served (on a kept-alive connection too), one past it is answered 431 with the
    connection closed (400 from h11 while it is still arriving), and the server goes on
    serving."""
    cfg = make_config(sqlite_url, limits={"max_header_bytes": 2048})
    rt = await Runtime.create(cfg, engine=ReferenceEngine())
    tr = HttpTransport(rt, {"listen": f"127.0.0.1:{port}"}, cfg)
    await tr.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        within = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 1900 + b"\r\n\r\n"
        for _ in range(2):  # twice on one connection: the count starts again per request
            writer.write(within)
            await writer.drain()
            head = await _response_head(reader)
            assert head.startswith(b"HTTP/1.1 200"), head
            length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))  # type: ignore[union-attr]
            await reader.readexactly(length)
        many = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 100) for i in range(30))
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")
        await writer.drain()
        head = await _response_head(reader)
        assert head.startswith(b"HTTP/1.1 431"), head
        rest = await asyncio.wait_for(reader.read(), 10)  # its body, then the close
        assert b"HTTP/1.1" not in rest
        await _close(writer)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 4000 + b"\r\n\r\n")
        await writer.drain()
        assert (await _response_head(reader)).startswith(b"HTTP/1.1 431")
        await _close(writer)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 4000)  # no end
        await writer.drain()
        assert (await _response_head(reader)).startswith(b"HTTP/1.1 400")
        await _close(writer)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
            assert (await c.get("/healthz")).status_code == 200
    finally:
        await tr.stop(grace=1.0)
        await rt.aclose()


async def test_bad_bytes_behind_a_whole_request_are_refused_after_its_answer(
    served: Served,
) -> None:
    """A close followed on its connection by bytes that are no request: the close is
    answered (200) before the 400 that ends the connection, so the client learns what
    its close did; bad bytes inside a request's own body are still refused at once."""
    host, port = served.url.removeprefix("http://").split(":")
    async with httpx.AsyncClient(base_url=served.url) as c:
        sid = (await c.post("/v1/sessions", json={})).json()["id"]
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        f"POST /v1/sessions/{sid}/close HTTP/1.1\r\nHost: x\r\n\r\n".encode()
        + b"e\r\n(\xfc\xb0 not a request\r\n\r\n"
    )
    await writer.drain()
    got = await asyncio.wait_for(reader.read(), 10)
    await _close(writer)
    statuses = re.findall(rb"HTTP/1\.1 (\d{3}) ", got)
    assert statuses == [b"200", b"400"], got[:400]
    assert (await served.runtime.get(sid)).status == "closed"
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"
    )
    await writer.drain()
    got = await asyncio.wait_for(reader.read(), 10)
    await _close(writer)
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", got) == [b"400"], got[:400]


async def test_slow_body_is_408_and_a_vanished_client_is_not_an_internal_error(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    host, port = served.url.removeprefix("http://").split(":")
    with caplog.at_level(logging.INFO):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b'POST /v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"la')
        await writer.drain()
        head = await _response_head(reader)
        await _close(writer)
        assert head.startswith(b"HTTP/1.1 408")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b'POST /v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"la')
        await writer.drain()
        await _close(writer)
        await asyncio.sleep(0.3)
        async with httpx.AsyncClient(base_url=served.url) as c:
            assert (await c.get("/healthz")).status_code == 200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def test_audit_route_reports_a_poisoned_session(
    client: httpx.AsyncClient, runtime: Runtime
) -> None:
    """What an older server stored for ``temperature: NaN`` (null): the audit answers, reporting the failure."""
    from sessiontape.core.engine.interface import SamplingParams
    from tests.helpers.hostile import poison

    sid = await _open(client)
    async for _ in runtime.generate(
        sid, GenerateRequest(SamplingParams(max_tokens=2, seed=1), append=[1, 2])
    ):
        pass
    await poison(runtime.log, sid)
    r = await client.get(f"/v1/sessions/{sid}/audit")
    assert r.status_code == 200, r.text
    report = r.json()
    assert report["ok"] is False and report["chain_ok"] is True
    assert len(report["problems"]) == 1 and "generation.started" in report["problems"][0]


async def test_concurrent_requests_per_client_are_bounded(sqlite_url: str, port: int) -> None:
    """Three open SSE streams from one address are its limit here: the fourth request is 429 at once,
    and once a stream closes the client is served again."""
    cfg = make_config(sqlite_url, limits={"max_requests_per_client": 3})
    rt = await Runtime.create(cfg, engine=ReferenceEngine())
    tr = HttpTransport(rt, {"listen": f"127.0.0.1:{port}", "heartbeat_s": 1.0}, cfg)
    await tr.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
            sid = (await c.post("/v1/sessions", json={})).json()["id"]
            async with contextlib.AsyncExitStack() as streams:
                for _ in range(3):
                    r = await streams.enter_async_context(
                        c.stream("GET", f"/v1/sessions/{sid}/events")
                    )
                    assert r.status_code == 200
                over = await c.get("/v1/sessions")
                assert (
                    over.status_code == 429 and over.json()["error"]["code"] == "too_many_requests"
                )
                assert (await c.get("/healthz")).status_code == 200  # probes are exempt
            assert (await c.get("/v1/sessions")).status_code == 200
    finally:
        await tr.stop(grace=1.0)
        await rt.aclose()
