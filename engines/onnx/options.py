"""The ONNX engine's options (``[engine.options]`` with ``engine.name = "onnx"``).

:class:`OnnxOptions` is the one place each option, its default and its bounds
are written; ``OnnxEngine(**keywords)`` and the configuration both read
through it, so a misspelled option is refused with the nearest name before
any model is imported or loaded. Options that depend on the model or the
provider (``max_length`` within the model's, ``batch_slots`` on a GQA graph)
are checked when the engine opens the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sessiontape.core.settings_framework import option
from sessiontape.engines.models.sampling_defaults import SamplingOptions
from sessiontape.engines.models.sources import DTYPES
from sessiontape.engines.onnx.demo import SIZES
from sessiontape.engines.onnx.importer import ATTENTIONS

#: the most KV slots a batch pool may have (each is a full-length buffer per layer)
MAX_BATCH_SLOTS = 1024


@dataclass(frozen=True)
class OnnxOptions(SamplingOptions):
    """``[engine.options]`` of the ONNX Runtime engine."""

    model: str | None = option(
        None,
        "a model source: a registry name (`smollm2-135m-instruct`), a `.gguf` file or a "
        "Hugging Face folder, imported into the model cache on first use (docs/models.md)",
        shown="SmolLM2-135M-Instruct when its package is installed, else the tiny demo model",
    )
    dtype: str = option(
        "auto",
        "how an imported model's weights are held (`auto`: GGUF blocks as they are)",
        choices=DTYPES,
    )
    attention: str = option(
        "auto",
        "an imported model's attention: `masked` (continuous batching, bit-exact), `gqa` "
        "(one fused operator per layer, no batching) or `auto`: `masked` where the engine "
        "batches (the CPU's growing buffers), else `gqa` (docs/models.md)",
        choices=("auto", *ATTENTIONS),
    )
    model_dir: Path | None = option(
        None,
        "or a folder with `model.onnx` (and optionally `config.json`, `tokenizer.json`, "
        "`chat_template.jinja`, `readout_concepts.json`), served as it is",
    )
    size: str | None = option(
        None, "or the demo model of this size, built on first use", choices=tuple(SIZES)
    )
    providers: str | tuple[str, ...] = option(
        "auto",
        "`auto` (CUDA when this build offers it and it loads, else CPU), or a list "
        "(or comma-separated string) of execution providers",
    )
    intra_op_threads: int | None = option(
        None, "ONNX Runtime's intra-op threads", ge=0, shown="all logical CPUs"
    )
    inter_op_threads: int = option(0, "inter-op threads (0: ONNX Runtime's default)", ge=0)
    spinning: bool = option(
        False,
        "let the intra-op threads spin while idle (on a shared machine spinning threads "
        "starve each other and the event loop)",
    )
    kv_cache_bytes: int = option(1 << 30, "bound on all sessions' KV caches (LRU)", ge=0)
    readout_concepts: Path | None = option(
        None,
        "a JSON file of concept directions for readouts",
        shown="the model folder's `readout_concepts.json`",
    )
    max_length: int | None = option(None, "context limit", ge=1, shown="the model's")
    prefill_chunk: int = option(256, "most new positions per forward pass", ge=1)
    io_binding: bool | None = option(None, "bind device tensors", shown="on with CUDA")
    workers: int = option(1, "forward passes running at once", ge=1)
    min_rows: int = option(
        2, "smallest query row count per pass (1 is faster, not guaranteed bit-exact)", ge=1
    )
    decode_batch: int = option(8, "most decode steps per worker-thread hop", ge=1)
    lookahead: bool = option(
        True,
        "fill the decode pass's spare row with a guessed next token (what followed the "
        "same two tokens earlier) instead of padding; results are the same either way",
    )
    pass_rows: int | None = option(
        None,
        "a static-layout model's query rows per pass; setting it (or `kv_capacity`) fixes "
        "the shape on any provider",
        ge=1,
        shown="16 on CUDA; unset on the CPU (passes of `min_rows`.. rows)",
    )
    kv_capacity: int | None = option(
        None,
        "a static-layout model's KV slots, rounded up to a multiple of 64",
        ge=2,
        shown="`max_length + 1` on CUDA; unset on the CPU (buffers grow in 256-slot steps)",
    )
    cuda_graph: bool | None = option(
        None,
        "capture the fixed-shape pass as a CUDA graph and replay it",
        shown="on with CUDA and a fixed shape",
    )
    batch_slots: int | None = option(
        None,
        "continuous batching: the decode steps of up to this many generating sessions run "
        "in one forward pass (0: off; not built for the fixed CUDA shape)",
        ge=0,
        le=MAX_BATCH_SLOTS,
        shown="8 on growing buffers (the CPU default), else 0",
    )
    batch_wait_s: float = option(
        30.0, "how long a generation waits for a free KV slot before `engine_busy`", ge=0
    )
    batch_prefill_share: int = option(
        1, "prefill chunks run between two decode passes while sessions decode", ge=1
    )
