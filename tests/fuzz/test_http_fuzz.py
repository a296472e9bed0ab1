"""Fuzz every route of the OpenAPI document over a real uvicorn on loopback.

Each request gets hostile path parameters, query values, headers and
bodies. The server must answer with a typed status (never 5xx), every
error body must be the problem JSON, and an error must leave every stored
session byte-for-byte as it was (the export before and after).
"""

from __future__ import annotations

import json
import re
import urllib.parse
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sessiontape.transports.http.server.openapi import spec
from tests.helpers.fuzz import LONG, QUICK, fuzz_settings
from tests.helpers.http_fuzz import Fuzzed, stored
from tests.helpers.strategies import HOSTILE_TEXT, body_for

#: errors after which nothing may have changed
REFUSALS = {400, 401, 404, 405, 408, 413, 422}
SPEC = spec()
OPERATIONS = [
    (path, method, op) for path, item in SPEC["paths"].items() for method, op in item.items()
]


@st.composite
def requests(draw: Any, path: str, method: str, op: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"method": method.upper(), "params": {}, "headers": {}, "body": None}
    names = re.findall(r"{(\w+)}", path)
    values = {}
    for name in names:
        v = draw(st.one_of(st.sampled_from(["@0", "@1"]), HOSTILE_TEXT))
        values[name] = v
    out["path"] = path
    out["path_values"] = values
    for p in op.get("parameters", []):
        if p["in"] == "path" or not draw(st.booleans()):
            continue
        value = draw(
            st.one_of(
                st.integers(-3, 10).map(str),
                st.sampled_from(p.get("schema", {}).get("enum", ["x"])),
                HOSTILE_TEXT,
            )
        )
        if p["in"] == "query":
            out["params"][p["name"]] = value
        elif p["in"] == "header":
            # raw bytes, as a client may send; only what HTTP/1.1 itself cannot carry is removed
            raw = re.sub(rb"[\x00-\x1f\x7f]", b"", value.encode("utf-8", "surrogatepass")).strip()
            if raw:
                out["headers"][p["name"]] = raw
    schema = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
    if method == "post":
        body = draw(body_for(schema))
        if (
            b'"background"' in body
        ):  # a generation outliving its request would race the byte-for-byte check
            body = body.replace(b'"background"', b'"backgroun"')
        out["body"] = body
    return out


async def _send(f: Fuzzed, req: dict[str, Any]) -> tuple[int, bytes, str]:
    path = req["path"]
    for name, v in req["path_values"].items():
        v = f.sids[int(v[1])] if v in ("@0", "@1") else v
        path = path.replace(
            "{" + name + "}", urllib.parse.quote(v, safe="", errors="surrogatepass")
        )
    headers = {**req["headers"], "content-type": b"application/json"}
    params = {
        k: v.encode("utf-8", "surrogatepass").decode("latin-1") for k, v in req["params"].items()
    }
    async with f.client.stream(
        req["method"], path, params=params, headers=headers, content=req["body"]
    ) as r:
        ctype = r.headers.get("content-type", "")
        if r.status_code < 400 and ctype.startswith("text/event-stream"):
            return (
                r.status_code,
                b"",
                ctype,
            )  # a live stream: the status is the answer; closing ends it
        return r.status_code, await r.aread(), ctype


async def _check(f: Fuzzed, req: dict[str, Any]) -> None:
    before = await stored(f)
    status, body, ctype = await _send(f, req)
    assert status < 500, (req, status, body[:300])
    if status >= 400:
        assert ctype.startswith("application/json"), (req, status, ctype)
        err = json.loads(body)["error"]
        assert err["code"] != "internal" and err["message"], (req, err)
    if status in REFUSALS:
        assert await stored(f) == before, (req, status, body[:300])


IDS = [f"{m.upper()} {p}" for p, m, _ in OPERATIONS]


@pytest.mark.parametrize(("path", "method", "op"), OPERATIONS, ids=IDS)
@fuzz_settings(QUICK)
@given(data=st.data())
async def test_http_route_fuzz(
    fuzzed: Fuzzed, path: str, method: str, op: dict[str, Any], data: Any
) -> None:
    await _check(fuzzed, data.draw(requests(path, method, op)))


@pytest.mark.fuzz
@pytest.mark.parametrize(("path", "method", "op"), OPERATIONS, ids=IDS)
@fuzz_settings(LONG)
@given(data=st.data())
async def test_http_route_fuzz_long(
    fuzzed: Fuzzed, path: str, method: str, op: dict[str, Any], data: Any
) -> None:
    await _check(fuzzed, data.draw(requests(path, method, op)))
