"""``sessiontape model import | readouts | list`` and the import cache, as a user runs them.

Real subprocesses on a small Llama checkpoint written as a GGUF in the test
(tests/helpers/checkpoints.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from tests.helpers import checkpoints as ck

EXE = [sys.executable, "-m", "sessiontape.core.cli"]


def run(*args: str, cache: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SESSIONTAPE_CACHE": str(cache)}
    proc = subprocess.run([*EXE, *args], capture_output=True, text=True, env=env, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} failed ({proc.returncode}): {proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("src") / "tiny-llama.Q4_0.gguf"
    ck.write_gguf(path, ck.LLAMA, ck.random_weights(ck.LLAMA), gguf.GGMLQuantizationType.Q4_0)
    return path


def test_import_writes_a_served_folder_with_provenance_and_concepts(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    out = tmp_path / "model"
    proc = run("model", "import", str(tiny_gguf), "--out", str(out), cache=tmp_path)
    assert proc.stdout.startswith("imported tiny-llama.Q4_0 ("), proc.stdout
    files = {p.name for p in out.iterdir()}
    assert {"model.onnx", "model.onnx.data", "tokenizer.json", "config.json"} <= files
    assert {"chat_template.jinja", "readout_concepts.json"} <= files
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_id"] == "tiny-llama.Q4_0" and cfg["dtype"] == "auto"
    assert cfg["attention"] == "gqa" and cfg["source"]["kind"] == "gguf"
    concepts = json.loads((out / "readout_concepts.json").read_text())
    assert concepts["concepts"] == ["question", "code", "positive", "negative", "number"]
    assert "difference of mean hidden states" in concepts["method"]
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temporary left


def test_readouts_from_a_user_examples_file(tiny_gguf: Path, tmp_path: Path) -> None:
    out = tmp_path / "model"
    run("model", "import", str(tiny_gguf), "--out", str(out), "--dtype", "q8", cache=tmp_path)
    examples = tmp_path / "examples.json"
    examples.write_text(json.dumps({"greeting": ["hello there", "hi"], "code": ["x = 1", "f()"]}))
    proc = run(
        "model",
        "readouts",
        str(out),
        "--examples",
        str(examples),
        "--layers",
        "1,2",
        cache=tmp_path,
    )
    assert "wrote 2 concepts" in proc.stdout
    doc = json.loads((out / "readout_concepts.json").read_text())
    assert doc["concepts"] == ["greeting", "code"] and doc["layers"] == [1, 2]
    assert doc["examples_per_concept"] == {"greeting": 2, "code": 2}
    before = (out / "readout_concepts.json").read_bytes()
    examples.write_text(json.dumps({"only": ["one concept is not a contrast"]}))
    bad = run(
        "model", "readouts", str(out), "--examples", str(examples), cache=tmp_path, check=False
    )
    assert bad.returncode != 0 and "at least two concepts" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert (out / "readout_concepts.json").read_bytes() == before  # unchanged


def test_an_unsupported_source_is_one_line_and_writes_nothing(tmp_path: Path) -> None:
    src = tmp_path / "phi.gguf"
    ck.write_gguf(src, ck.LLAMA, ck.random_weights(ck.LLAMA), gguf_arch="phi2")
    out = tmp_path / "out"
    proc = run("model", "import", str(src), "--out", str(out), cache=tmp_path, check=False)
    assert proc.returncode != 0
    assert "'phi2' is not supported" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not out.exists()


def test_the_cache_imports_once_per_source_dtype_and_attention(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sessiontape.engines.onnx.importer import ensure_imported, import_dtype, source_sha256

    monkeypatch.setenv("SESSIONTAPE_CACHE", str(tmp_path))
    first = ensure_imported(str(tiny_gguf))
    stamp = (first / "model.onnx").stat().st_mtime_ns
    assert ensure_imported(str(tiny_gguf)) == first  # reused, not rebuilt
    assert (first / "model.onnx").stat().st_mtime_ns == stamp
    # auto, or float32 on a CPU whose int8 products are inexact (importer.import_dtype)
    dtype = import_dtype("auto", tiny_gguf)
    assert first.name.startswith(f"{source_sha256(tiny_gguf)[:16]}-{dtype}-gqa-")
    masked = ensure_imported(str(tiny_gguf), attention="masked")
    assert masked != first and json.loads((masked / "config.json").read_text())["attention"] == (
        "masked"
    )


def test_float16_from_the_command_line_and_the_engine_option(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import numpy as np
    import onnx

    from sessiontape.engines.onnx.engine import OnnxEngine

    out = tmp_path / "model"
    proc = run(
        "model", "import", str(tiny_gguf), "--out", str(out), "--dtype", "float16", cache=tmp_path
    )
    assert "float16" in proc.stdout, proc.stdout
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16"
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    past = [v for v in graph.input if v.name.startswith("past_key_values.")]
    assert past and all(v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16 for v in past)
    monkeypatch.setenv("SESSIONTAPE_CACHE", str(tmp_path / "cache"))
    eng = OnnxEngine(model=str(tiny_gguf), dtype="float16", intra_op_threads=1)
    try:
        # attention "auto": masked where sessions batch (the CPU), gqa on CUDA
        kind = "gqa" if eng.info.provider.startswith("CUDA") else "masked"
        assert f"-float16-{kind}-" in Path(eng.model_dir).name
        assert np.dtype(eng.spec.kv_dtype) == np.float16
    finally:
        asyncio.run(eng.aclose())


def test_list_names_the_registry_models(tmp_path: Path) -> None:
    proc = run("model", "list", cache=tmp_path)
    assert proc.stdout.startswith("smollm2-135m-instruct")


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("dtype", "float64", "unknown dtype 'float64'"),
        ("dtype", 4, "unknown dtype '4'"),
        ("attention", "flash", "unknown attention 'flash'"),
        ("model", "/nonexistent/model.gguf", "does not exist"),
    ],
)
def test_bad_model_options_are_config_errors_and_import_nothing(
    tiny_gguf: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    option: str,
    value: object,
    message: str,
) -> None:
    from sessiontape.core.errors import ConfigError
    from sessiontape.engines.onnx.engine import OnnxEngine

    monkeypatch.setenv("SESSIONTAPE_CACHE", str(tmp_path / "cache"))
    options: dict[str, object] = {"model": str(tiny_gguf), option: value}
    with pytest.raises(ConfigError, match=message):
        OnnxEngine(**options)  # type: ignore[arg-type]
    imported = tmp_path / "cache" / "models" / "imported"
    assert not imported.exists() or not any(imported.iterdir())


def test_serve_with_a_missing_model_says_so_in_one_line(tmp_path: Path) -> None:
    db = tmp_path / "st.db"
    proc = run(
        "serve",
        "--db",
        f"sqlite+aiosqlite:///{db}",
        "--no-grpc",
        "--http",
        "127.0.0.1:1",
        "--model",
        str(tmp_path / "missing.gguf"),
        cache=tmp_path,
        check=False,
    )
    assert proc.returncode != 0 and "missing.gguf does not exist" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not db.exists()


def test_the_engine_imports_masked_attention_where_it_batches_and_gqa_where_not(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``attention = "auto"`` (the default): a CPU engine, which batches sessions, serves the
    masked graph and batches; with batching off, a CUDA provider or a fixed pass shape,
    nothing batches and it serves GroupQueryAttention; a named attention is kept."""
    from sessiontape.engines.onnx.engine import OnnxEngine
    from sessiontape.engines.onnx.loading import import_attention
    from sessiontape.engines.onnx.options import OnnxOptions
    from sessiontape.engines.onnx.runner import CPU, CUDA

    monkeypatch.setenv("SESSIONTAPE_CACHE", str(tmp_path))
    assert OnnxOptions().attention == "auto"
    assert import_attention(OnnxOptions(), [CPU]) == "masked"
    assert import_attention(OnnxOptions(), [CUDA, CPU]) == "gqa"
    assert import_attention(OnnxOptions(batch_slots=0), [CPU]) == "gqa"
    assert import_attention(OnnxOptions(pass_rows=8), [CPU]) == "gqa"
    assert import_attention(OnnxOptions(kv_capacity=128), [CPU]) == "gqa"
    assert import_attention(OnnxOptions(attention="gqa"), [CPU]) == "gqa"
    assert import_attention(OnnxOptions(attention="masked"), [CUDA, CPU]) == "masked"
    for options, kind, batched in (
        ({}, "masked", True),
        ({"batch_slots": 0}, "gqa", False),
        ({"attention": "gqa"}, "gqa", False),
    ):
        eng = OnnxEngine(model=str(tiny_gguf), providers="CPUExecutionProvider", **options)
        try:
            folder = Path(eng.model_dir)
            assert f"-{kind}-" in folder.name, (options, folder.name)
            assert json.loads((folder / "config.json").read_text())["attention"] == kind
            assert eng.info.extra["batch_slots"] == (8 if batched else 0), options
        finally:
            asyncio.run(eng.aclose())


def test_a_prefill_runs_the_head_on_its_last_rows_with_the_bits_of_all_rows(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An imported graph computes logits from the row ``logits_from`` names (default 0): a
    prefill pass asks for its last rows only, and gets the bits the head gives with every
    row; it never gets fewer than ``min_rows`` rows (a lone row takes another kernel path)."""
    import numpy as np

    from sessiontape.core.errors import EngineError
    from sessiontape.engines.onnx.engine import OnnxEngine
    from sessiontape.engines.onnx.static import StaticRunner

    monkeypatch.setenv("SESSIONTAPE_CACHE", str(tmp_path))
    eng = OnnxEngine(model=str(tiny_gguf), providers="CPUExecutionProvider", batch_slots=0)
    try:
        runner = eng.runner
        assert isinstance(runner, StaticRunner) and runner.logits_from
        tokens = [5, 9, 17, 3, 22, 8, 1, 30, 12, 7]
        full = runner.run(runner.empty(), 0, tokens, ())
        assert full.logits_from == 0 and full.logits.shape[0] == len(tokens)
        tail = runner.run(runner.empty(), 0, tokens, (), logits_from=len(tokens) - 1)
        assert tail.logits_from == len(tokens) - runner.min_rows
        assert tail.logits.shape[0] == runner.min_rows
        for row in range(tail.logits_from, len(tokens)):
            assert np.array_equal(tail.row_logits(row), full.row_logits(row))
        with pytest.raises(EngineError, match="logits from row"):
            tail.row_logits(0)
    finally:
        asyncio.run(eng.aclose())
