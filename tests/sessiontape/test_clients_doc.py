"""docs/clients.md's Python examples, run in order against a live server (with a bearer token), so
the side-by-side guide cannot rot: the OpenAI SDK and sessiontape.client blocks, as written."""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sessiontape.core.runtime import Runtime
from sessiontape.engines.reference import ReferenceEngine
from sessiontape.transports.http.plugin import HttpTransport
from tests.helpers.config import make_config
from tests.helpers.http import Served

DOC = Path(__file__).resolve().parents[2] / "docs" / "clients.md"


@pytest.fixture
async def live(sqlite_url: str, port: int) -> AsyncIterator[Served]:
    cfg = make_config(sqlite_url, auth={"token": "TOKEN"})
    rt = await Runtime.create(cfg, engine=ReferenceEngine())
    tr = HttpTransport(rt, {"listen": f"127.0.0.1:{port}", "heartbeat_s": 1.0}, cfg)
    await tr.start()
    try:
        yield Served(rt, tr, f"http://127.0.0.1:{port}")
    finally:
        await tr.stop(grace=1.0)
        await rt.aclose()


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_the_guide_shows_each_client_side_by_side() -> None:
    text = DOC.read_text()
    heads = re.findall(r"^## (.+)$", text, flags=re.M)
    firsts = re.findall(r"```(\w+)\n# ?([^\n]*)", text)
    assert {"Setup", "One turn", "Continue, or branch", "Stream", "Errors"} <= set(heads)
    kinds = {lang + ":" + first.split(":")[0] for lang, first in firsts}
    assert {"python:OpenAI SDK", "python:sessiontape.client", "sh:curl"} <= kinds, kinds


async def test_the_python_examples_run(live: Served) -> None:
    blocks = python_blocks(DOC.read_text())
    assert len(blocks) >= 10
    source = "\n".join(blocks).replace("http://127.0.0.1:8080", live.url)
    out = io.StringIO()

    def run() -> dict[str, object]:
        scope: dict[str, object] = {}
        with contextlib.redirect_stdout(out):
            exec(compile(source, str(DOC), "exec"), scope)
        return scope

    scope = await asyncio.to_thread(run)
    printed = out.getvalue()
    assert "invalid_parameters n" in printed  # the OpenAI SDK's error example
    assert "404 session_not_found" in printed  # the native client's
    sid = scope["sid"]
    assert isinstance(sid, str)
    assert (await live.runtime.get(sid)).status == "closed"


def test_the_curl_examples_name_documented_routes_and_valid_json() -> None:
    """Each curl line of the guide: its route and method are in the OpenAPI document, and its -d body
    is a JSON object."""
    import json

    from sessiontape.transports.http.server.openapi import spec

    doc = spec()
    text = "\n".join(re.findall(r"```sh\n(.*?)```", DOC.read_text(), flags=re.S))
    text = text.replace("\\\n", " ").replace("'$SID'", "s_x").replace("$SID", "s_x")
    curls = [line.strip() for line in text.splitlines() if line.strip().startswith("curl")]
    assert len(curls) >= 12
    for line in curls:
        m = re.search(r"localhost:8080(/[^ \"'?]*)", line)
        assert m is not None, line
        body = re.search(r"-d '([^']*)'", line)
        method = "post" if ("-XPOST" in line or body) else "get"
        templates = [
            p
            for p in doc["paths"]
            if re.fullmatch(re.sub(r"\\\{\w+\\\}", "[^/]+", re.escape(p)), m.group(1))
        ]
        assert templates and method in doc["paths"][templates[0]], line
        if body:
            assert isinstance(json.loads(body.group(1)), dict), line
