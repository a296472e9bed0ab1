"""The HTTP access log: one record per request, as text or as JSON lines (``--log-format json``)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx
import pytest

from tests.helpers.config import free_port
from tests.helpers.http import Served
from tests.helpers.serve import start, stop


async def test_every_request_is_logged_with_its_route_and_session(
    server: Served, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, "sessiontape.access"):
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as c:
            sid = (await c.post("/v1/sessions", json={"label": "log me"})).json()["id"]
            r = await c.post(
                f"/v1/sessions/{sid}/generate",
                json={"text": "hi", "max_tokens": 3, "stream": False},
            )
            assert r.status_code == 200
            assert (await c.get("/v1/sessions/s_nope")).status_code == 404
            assert (await c.get("/healthz")).status_code == 200
    recs = [r for r in caplog.records if r.name == "sessiontape.access"]
    got = [(r.method, r.route, r.status, r.session_id) for r in recs]  # type: ignore[attr-defined]
    assert got == [
        ("POST", "/v1/sessions", 201, None),
        ("POST", "/v1/sessions/{sid}/generate", 200, sid),
        ("GET", "/v1/sessions/{sid}", 404, "s_nope"),
        ("GET", "/healthz", 200, None),
    ]
    for r in recs:
        assert str(r.request_id).startswith("req_")  # type: ignore[attr-defined]
        assert r.duration_s >= 0 and r.bytes > 0  # type: ignore[attr-defined]
        assert r.client.startswith("127.0.0.1:")  # type: ignore[attr-defined]
    assert len({r.request_id for r in recs}) == 4  # type: ignore[attr-defined]
    assert f"POST /v1/sessions/{sid}/generate 200 " in recs[1].getMessage()


async def test_a_path_cannot_forge_log_lines(
    server: Served, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, "sessiontape.access"):
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as c:
            assert (await c.get("/v1/sessions/a%0aINFO%20forged")).status_code == 404
    [rec] = [r for r in caplog.records if r.name == "sessiontape.access"]
    assert "\n" not in rec.getMessage() and "/v1/sessions/a%0aINFO%20forged" in rec.getMessage()


def test_serve_writes_json_lines(tmp_path: Path) -> None:
    h = free_port()
    proc, lines = start(
        tmp_path,
        "--engine",
        "reference",
        "--no-grpc",
        "--http",
        f"127.0.0.1:{h}",
        "--log-format",
        "json",
    )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{h}", timeout=30) as c:
            sid = c.post("/v1/sessions", json={}).json()["id"]
            assert c.get(f"/v1/sessions/{sid}").status_code == 200
    finally:
        code, rest = stop(proc)
    assert code == 0, rest
    objs = [
        json.loads(line) for line in [*lines, *rest.splitlines()] if line.strip()
    ]  # every line is JSON
    assert any(o["msg"].startswith("sessiontape ready") for o in objs)
    access = [o for o in objs if o["logger"] == "sessiontape.access"]
    assert [(o["method"], o["route"], o["status"], o["session_id"]) for o in access] == [
        ("POST", "/v1/sessions", 201, None),
        ("GET", "/v1/sessions/{sid}", 200, sid),
    ]
    for o in access:
        assert {"ts", "level", "request_id", "duration_s", "path", "bytes"} <= set(o)
        assert o["request_id"].startswith("req_") and isinstance(o["duration_s"], float)


def test_access_log_can_be_turned_off_and_bad_formats_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "quiet.toml"
    cfg.write_text('[logging]\naccess_log = false\nformat = "json"\n')
    h = free_port()
    proc, lines = start(
        tmp_path,
        "--config",
        str(cfg),
        "--engine",
        "reference",
        "--no-grpc",
        "--http",
        f"127.0.0.1:{h}",
    )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{h}", timeout=30) as c:
            assert c.get("/healthz").status_code == 200
    finally:
        code, rest = stop(proc)
    assert code == 0
    objs = [json.loads(line) for line in [*lines, *rest.splitlines()] if line.strip()]
    assert objs and not [o for o in objs if o["logger"] == "sessiontape.access"]
    import subprocess
    import sys

    bad = tmp_path / "bad.toml"
    bad.write_text('[logging]\nformat = "xml"\n')
    p = subprocess.run(
        [sys.executable, "-m", "sessiontape.core.cli", "sessions", "ls", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        p.returncode == 2
        and p.stderr.strip()
        == "sessiontape: error: unknown format 'xml': logging.format must be one of text, json"
    )
