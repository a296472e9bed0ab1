"""Stopping `sessiontape serve` with streams open: every stream ends cleanly, nothing is logged as an error.

Before, uvicorn cancelled the open event streams at its deadline and logged each as "Exception in
ASGI application" with a CancelledError traceback (and skipped the app's shutdown).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from tests.helpers.config import free_port
from tests.helpers.serve import start, stop


def _open_stream(port: int, method: str, path: str, body: bytes = b"") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return s


def _read_all(s: socket.socket) -> bytes:
    out = b""
    with s:
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_stop_ends_open_streams_cleanly(tmp_path: Path) -> None:
    cfg = tmp_path / "slow.toml"
    # a generation that outlives the grace period: 0.05 s a token, 2000 tokens, never EOS
    cfg.write_text(
        '[engine]\nname = "reference"\n[engine.options]\nstep_delay_s = 0.05\neos_bias = -100.0\n'
        "[transports.http]\ngrace_s = 1.0\n"
    )
    h = free_port()
    proc, _ = start(tmp_path, "--config", str(cfg), "--no-grpc", "--http", f"127.0.0.1:{h}")
    streams = []
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{h}", timeout=30) as c:
            sid = c.post("/v1/sessions", json={}).json()["id"]
            c.post(f"/v1/sessions/{sid}/append", json={"text": "Hello"}).raise_for_status()
        streams = [
            _open_stream(h, "GET", f"/v1/sessions/{sid}/events"),
            _open_stream(h, "GET", "/v1/sessions/events"),
            _open_stream(
                h, "POST", f"/v1/sessions/{sid}/generate", json.dumps({"max_tokens": 2000}).encode()
            ),
        ]
        for s in streams:  # each answered and streaming before the stop
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
    finally:
        code, rest = stop(proc)
    bodies = [_read_all(s) for s in streams]
    assert code == 0, rest
    for word in (
        "Traceback",
        "Exception in ASGI application",
        "CancelledError",
        "Task was destroyed",
        "timeout graceful shutdown exceeded",
        "ERROR",
    ):
        assert word not in rest, rest
    for b in bodies:  # a chunked body that ends with its last chunk: an ordinary end of stream
        assert b.endswith(b"0\r\n\r\n"), b[-200:]
    # the generation the stop cut short is in the log, recorded as cancelled
    listed = json.loads(
        subprocess.run(
            [
                sys.executable,
                "-m",
                "sessiontape.core.cli",
                "sessions",
                "show",
                sid,
                "--json",
                "--db",
                f"sqlite+aiosqlite:///{tmp_path / 'st.db'}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    )
    assert [g["finish_reason"] for g in listed["generations"]] == ["cancelled"]
