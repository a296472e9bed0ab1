"""`sessiontape serve` as a user runs it: a real process, real ports, SIGTERM."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.helpers.config import free_port
from tests.helpers.serve import start, stop


def test_serve_defaults_to_the_real_chat_model_over_http_openai_and_grpc(
    tmp_path: Path, real_model_cache: Path
) -> None:
    """The newcomer's `serve`: SmolLM2-135M-Instruct (the installed wheel), answering for real."""
    import openai

    g, h = free_port(), free_port()
    proc, lines = start(
        tmp_path, "--grpc", f"127.0.0.1:{g}", "--http", f"127.0.0.1:{h}", cache=real_model_cache
    )
    try:
        log = "\n".join(lines)
        assert "grpc: " in log and f"127.0.0.1:{g}" in log
        assert "http: " in log and f"127.0.0.1:{h}" in log
        assert "engine onnx" in log and "smollm2-135m-instruct" in log
        assert "importing" not in log  # the cache already holds the import
        base = f"http://127.0.0.1:{h}"
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        [model] = client.models.list().data
        assert model.id == "smollm2-135m-instruct"
        # what a request naming no sampling gets: the model card's recommendation
        assert (model.model_extra or {})["sampling"] == {"temperature": 0.2, "top_p": 0.9}
        reply = client.chat.completions.create(
            model=model.id,
            messages=[{"role": "user", "content": "What is 2 + 2? Answer with a number."}],
            max_tokens=24,
            temperature=0,
        )
        text = reply.choices[0].message.content or ""
        assert "4" in text and "<|im" not in text, text
        assert reply.choices[0].finish_reason == "stop"  # the model ended its turn
        with httpx.Client(base_url=base, timeout=30) as c:
            assert c.get("/healthz").status_code == 200
            sid = c.post("/v1/sessions", json={}).json()["id"]
            c.post(f"/v1/sessions/{sid}/append", json={"text": "Hello"}).raise_for_status()
            prompt = len(c.get(f"/v1/sessions/{sid}").json()["history"]["ids"])
            r = c.post(
                f"/v1/sessions/{sid}/generate", json={"max_tokens": 4, "seed": 1, "stream": False}
            )
            r.raise_for_status()
            assert r.json()["generation"]["finish_reason"] in ("length", "eos")
            doc = c.get(f"/v1/sessions/{sid}").json()
            engine = doc["engine"]
            assert engine["engine"] == "onnx" and engine["model_id"] == "smollm2-135m-instruct"
            assert engine["provider"] in ("CPUExecutionProvider", "CUDAExecutionProvider")
            assert len(engine["model_hash"]) == 64 and len(engine["source_sha256"]) == 64
            assert len(engine["tokenizer_sha256"]) == 64
            assert len(engine["chat_template_sha256"]) == 64
            n_generated = len(doc["history"]["ids"]) - prompt
            assert "sessiontape_events_appended_total" in c.get("/metrics").text
        with grpc.insecure_channel(f"127.0.0.1:{g}") as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=10
            )
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        code, rest = stop(proc)
    assert code == 0, rest
    assert "shutting down" in rest
    listed = subprocess.run(
        [
            sys.executable,
            "-m",
            "sessiontape.core.cli",
            "sessions",
            "ls",
            "--json",
            "--db",
            f"sqlite+aiosqlite:///{tmp_path / 'st.db'}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    rows = {row["id"]: row for row in json.loads(listed.stdout)}
    assert rows[sid]["engine"] == "onnx"
    assert rows[sid]["history_length"] == prompt + n_generated and 1 <= n_generated <= 4


def test_serve_demo_model_on_request(tmp_path: Path) -> None:
    """`--model` with a demo folder serves it (the demo models stay for tests and benchmarks)."""
    from sessiontape.engines.onnx.demo import build_demo

    folder = build_demo("tiny", tmp_path / "tiny").parent
    h = free_port()
    proc, _ = start(tmp_path, "--no-grpc", "--http", f"127.0.0.1:{h}", "--model", str(folder))
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{h}", timeout=30) as c:
            sid = c.post("/v1/sessions", json={}).json()["id"]
            c.post(f"/v1/sessions/{sid}/append", json={"text": "Hello"}).raise_for_status()
            doc = c.get(f"/v1/sessions/{sid}").json()
            assert doc["engine"]["model_id"] == "sessiontape-demo-tiny"
            assert len(doc["history"]["ids"]) == 5  # the demo's byte tokenizer
    finally:
        code, rest = stop(proc)
    assert code == 0, rest


@pytest.mark.parametrize("event_loop", ["auto", "asyncio"])
def test_serve_on_either_event_loop_generates_the_same_tokens(
    tmp_path: Path, event_loop: str
) -> None:
    """`[server] event_loop`: uvloop by default, asyncio's on request; the same seeded turn
    over Kakeya and HTTP gives the same tokens on both."""
    from sessiontape.transports.grpc.gen.kakeya.v1 import runtime_pb2 as kpb
    from sessiontape.transports.grpc.gen.kakeya.v1 import runtime_pb2_grpc as kgrpc

    (tmp_path / "sessiontape.toml").write_text(f'[server]\nevent_loop = "{event_loop}"\n')
    g, h = free_port(), free_port()
    proc, lines = start(
        tmp_path, "--engine", "reference", "--grpc", f"127.0.0.1:{g}", "--http", f"127.0.0.1:{h}"
    )
    try:
        ready = next(line for line in lines if "sessiontape ready" in line)
        assert f"event loop {'uvloop' if event_loop == 'auto' else 'asyncio'}" in ready
        with grpc.insecure_channel(f"127.0.0.1:{g}") as ch:
            kakeya = kgrpc.RuntimeServiceStub(ch)
            sid = kakeya.CreateSession(kpb.CreateSessionRequest()).session_id
            kakeya.AppendTokens(kpb.AppendTokensRequest(session_id=sid, token_ids=[5, 6, 7]))
            stream = kakeya.Generate(kpb.GenerateRequest(session_id=sid, max_tokens=12, seed=3))
            grpc_ids = [m.token_id for m in stream if m.WhichOneof("payload") == "token_id"]
        with httpx.Client(base_url=f"http://127.0.0.1:{h}", timeout=30) as c:
            hid = c.post("/v1/sessions", json={}).json()["id"]
            c.post(f"/v1/sessions/{hid}/append", json={"tokens": [5, 6, 7]}).raise_for_status()
            body = {"max_tokens": 12, "seed": 3, "stream": False}
            r = c.post(f"/v1/sessions/{hid}/generate", json=body)
            r.raise_for_status()
            http_ids = c.get(f"/v1/sessions/{hid}").json()["history"]["ids"][3:]
    finally:
        code, rest = stop(proc)
    assert code == 0, rest
    assert 1 <= len(grpc_ids) <= 12 and grpc_ids == http_ids


def test_serve_refuses_bad_config_with_one_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sessiontape.core.cli",
            "serve",
            "--engine",
            "nope",
            "--db",
            f"sqlite+aiosqlite:///{tmp_path / 'x.db'}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith("sessiontape: error: no engine named 'nope'")
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sessiontape.core.cli",
            "serve",
            "--engine",
            "reference",
            "--grpc",
            "nonsense",
            "--db",
            f"sqlite+aiosqlite:///{tmp_path / 'x.db'}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "HOST:PORT" in proc.stderr


def test_event_loop_choice_without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where uvloop cannot be imported, `auto` falls back to asyncio's loop and `uvloop` is a
    ConfigError that says so."""
    import uvloop

    from sessiontape.core.commands.serve import loop_factory
    from sessiontape.core.errors import ConfigError

    assert loop_factory("auto") is uvloop.new_event_loop
    assert loop_factory("asyncio") is None
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    assert loop_factory("auto") is None
    with pytest.raises(ConfigError, match="uvloop is not installed"):
        loop_factory("uvloop")


def test_a_second_server_on_one_sqlite_file_exits_at_once(tmp_path: Path) -> None:
    """One server per SQLite file: the second finds the file's lock held and says so; the
    first goes on serving, and readers (``sessions ls``) take no lock."""
    h = free_port()
    first, _ = start(tmp_path, "--engine", "reference", "--no-grpc", "--http", f"127.0.0.1:{h}")
    try:
        db = f"sqlite+aiosqlite:///{tmp_path / 'st.db'}"
        t0 = time.monotonic()
        second = subprocess.run(
            [
                *(sys.executable, "-m", "sessiontape.core.cli", "serve", "--db", db),
                *("--engine", "reference", "--no-grpc", "--http", f"127.0.0.1:{free_port()}"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )
        assert second.returncode == 1, second.stderr
        assert "another sessiontape server is serving" in second.stderr
        assert str(tmp_path / "st.db") in second.stderr
        assert time.monotonic() - t0 < 30
        assert httpx.get(f"http://127.0.0.1:{h}/healthz", timeout=10).status_code == 200
        listed = subprocess.run(
            [sys.executable, "-m", "sessiontape.core.cli", "sessions", "ls", "--db", db],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )
        assert listed.returncode == 0, listed.stderr
    finally:
        code, _ = stop(first)
    assert code == 0
