"""Fuzz the HTTP server below the routes: raw HTTP/1.1 bytes on a socket (request
lines, header lines, ``Content-Length`` and ``Transfer-Encoding`` that lie or clash,
chunked bodies with bad sizes, bare LF line ends, a stream cut anywhere), as uvicorn's
httptools protocol and sessiontape's guard (transports/http/plugin.py) parse them.

Every answer must be a status under 500, nothing may be logged at ERROR (uvicorn's and
sessiontape's loggers), and when no request was answered 2xx every stored session must
be as it was. The socket is read until the server closes it or stays silent past the
header and body deadlines (0.5 s each here)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sessiontape.core.runtime import Runtime
from sessiontape.engines.reference import ReferenceEngine
from sessiontape.transports.http.plugin import HttpTransport
from tests.helpers.config import make_config
from tests.helpers.fuzz import LONG, QUICK, LoggedErrors, fuzz_settings

#: a response's status line, wherever one starts in what the server sent
STATUS = re.compile(rb"(?:^|\r\n)HTTP/1\.[01] (\d{3}) ")
TARGETS = (
    b"/healthz",
    b"/v1/sessions",
    b"/v1/sessions/@/append",
    b"/v1/sessions/@/generate",
    b"/v1/sessions/@/close",
    b"/v1/responses",
    b"/nowhere",
    b"*",
    b"http://x/v1/sessions",
)
HEADER_NAMES = (
    b"Host",
    b"Content-Length",
    b"Transfer-Encoding",
    b"Content-Type",
    b"Expect",
    b"Connection",
    b"Authorization",
    b"Prefer",
    b"X-Pad",
)
HEADER_VALUES = (
    b"0",
    b"-1",
    b"7",
    b"99999999999999999999",
    b"chunked",
    b"gzip, chunked",
    b"application/json",
    b"100-continue",
    b"close",
    b"keep-alive",
    b"return=minimal",
    b"x",
)


@dataclass
class Served:
    runtime: Runtime
    port: int
    sid: str
    errors: list[str] = field(default_factory=list)


@pytest.fixture
async def served(sqlite_url: str, port: int) -> AsyncIterator[Served]:
    cfg = make_config(
        sqlite_url,
        limits={
            "max_body_bytes": 4096,
            "max_header_bytes": 1024,
            "header_timeout_s": 0.5,
            "body_timeout_s": 0.5,
        },
    )
    rt = await Runtime.create(cfg, engine=ReferenceEngine(max_length=256))
    tr = HttpTransport(rt, {"listen": f"127.0.0.1:{port}"}, cfg)
    await tr.start()
    st_ = await rt.open_session("http")
    await rt.append_text(st_.session_id, "a stored prompt")
    errors: list[str] = []
    handler = LoggedErrors(errors)
    loggers = [logging.getLogger(n) for n in ("sessiontape", "uvicorn", "uvicorn.error")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        yield Served(rt, port, st_.session_id, errors)
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
        await tr.stop(grace=1.0)
        await rt.aclose()


async def _stored(s: Served) -> str:
    while s.runtime.generations.is_running(s.sid):  # noqa: ASYNC110 - a cut request's generation ends
        await asyncio.sleep(0.01)
    rows = await s.runtime.log.list_sessions(limit=10_000)
    return json.dumps(
        [[e.to_json() for e in await s.runtime.log.read(r.id)] for r in rows], sort_keys=True
    )


#: bodies a route takes (or nearly): the fuzz reaches the app, not only the parser
JSON_BODIES = (b"{}", b'{"text": "hi", "max_tokens": 2}', b'{"tokens": [1, 2]}', b'{"reason": 1}')


def sometimes(usual: st.SearchStrategy[bytes], odd: st.SearchStrategy[bytes]) -> Any:
    """``usual`` three times in four, ``odd`` the fourth."""
    return st.integers(0, 3).flatmap(lambda i: odd if i == 0 else usual)


@st.composite
def header_lines(draw: Any) -> list[bytes]:
    lines = []
    for _ in range(draw(st.integers(0, 5))):
        name = draw(sometimes(st.sampled_from(HEADER_NAMES), st.binary(min_size=1, max_size=8)))
        value = draw(sometimes(st.sampled_from(HEADER_VALUES), st.binary(max_size=24)))
        shape = draw(st.sampled_from(("plain",) * 9 + ("no colon", "folded", "spaced")))
        if shape == "no colon":
            lines.append(name + b" " + value)
        elif shape == "folded":
            lines.append(b" " + value)  # obs-fold: a continuation of the line before
        elif shape == "spaced":
            lines.append(name + b" : " + value)
        else:
            lines.append(name + b": " + value)
    return lines


@st.composite
def bodies(draw: Any) -> bytes:
    if draw(st.booleans()):
        return draw(sometimes(st.sampled_from(JSON_BODIES), st.binary(max_size=48)))
    out = b""
    for _ in range(draw(st.integers(0, 3))):
        data = draw(st.binary(max_size=16))
        size = draw(
            st.one_of(
                st.just(b"%x" % len(data)),
                st.sampled_from((b"zz", b"-1", b"ffffffffffffffffff", b"3;ext=1", b"")),
            )
        )
        out += size + b"\r\n" + data + b"\r\n"
    return out + draw(st.sampled_from((b"0\r\n\r\n", b"0\r\n", b"")))


@st.composite
def raw_requests(draw: Any) -> bytes:
    method = draw(st.sampled_from((b"GET", b"POST", b"POST", b"PUT", b"DELETE", b"G\x00T")))
    target = draw(st.sampled_from(TARGETS)) + draw(sometimes(st.just(b""), st.binary(max_size=8)))
    version = draw(st.sampled_from((b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"")))
    eol = draw(st.sampled_from((b"\r\n", b"\r\n", b"\n")))
    lines = [method + b" " + target + b" " + version, b"Host: x", *draw(header_lines())]
    raw = eol.join(lines) + eol + eol + draw(bodies())
    if draw(st.booleans()):  # a second request behind it on the same connection
        raw += b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    cut = draw(st.integers(0, len(raw)))
    return raw if draw(st.integers(0, 3)) else raw[:cut]


async def _exchange(port: int, raw: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        got = b""
        while True:
            try:
                chunk = await asyncio.wait_for(reader.read(65536), 2.0)
            except TimeoutError:
                return got  # silent past both deadlines: an answer would have come
            if not chunk:
                return got
            got += chunk
    except ConnectionError:
        return b""
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def _check(s: Served, raw: bytes) -> None:
    raw = raw.replace(b"/@/", b"/" + s.sid.encode() + b"/")
    before = await _stored(s)
    s.errors.clear()
    got = await _exchange(s.port, raw)
    statuses = [int(m) for m in STATUS.findall(got)]
    assert all(code < 500 for code in statuses), (raw, got[:600])
    assert not s.errors, (raw, s.errors)
    if not any(200 <= code < 300 for code in statuses):
        assert await _stored(s) == before, (raw, got[:600])


@fuzz_settings(QUICK * 2)
@given(raw=raw_requests())
async def test_http_frame_fuzz(served: Served, raw: bytes) -> None:
    await _check(served, raw)


@pytest.mark.fuzz
@fuzz_settings(LONG)
@given(raw=raw_requests())
async def test_http_frame_fuzz_long(served: Served, raw: bytes) -> None:
    await _check(served, raw)


async def test_the_fuzz_sees_answers_refusals_and_silence(served: Served) -> None:
    """What the checks rest on: a whole request is answered, a bad one refused below
    500, and a cut one met with silence or a close, not an answer made up."""
    ok = await _exchange(served.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert [int(m) for m in STATUS.findall(ok)] == [200]
    bad = await _exchange(served.port, b"GET /healthz HTTP/1.1\r\nHost x\r\n\r\n")
    assert [int(m) for m in STATUS.findall(bad)] == [400]
    cut = await _exchange(served.port, b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Le")
    assert all(int(m) < 500 for m in STATUS.findall(cut))
    assert not served.errors
