"""Loading the model an :class:`~sessiontape.engines.onnx.engine.OnnxEngine` serves.

:func:`load_model` goes from :class:`OnnxOptions` to what the engine runs,
one step at a time: open the model folder's session and read its facts
(:func:`open_model`), bound the context (:func:`context_limit`), choose the
runner for the graph's KV layout (:func:`choose_runner`), load the readout
concepts and the tokenizer, decide continuous batching (:func:`batch_slots`),
describe the engine (:func:`engine_info`) and start the batch scheduler
(:func:`batch_scheduler`). An option the model cannot take (a ``max_length``
past the model's, ``pass_rows`` on a concat-layout graph, ``batch_slots`` on a
GQA graph) is a ConfigError from the step that finds it out.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sessiontape.core.engine.interface import EngineInfo, ModelSampling
from sessiontape.core.errors import ConfigError, EngineError
from sessiontape.engines.model_spec import SLOT_BLOCK
from sessiontape.engines.models.registry import REGISTRY
from sessiontape.engines.models.sampling_defaults import layered
from sessiontape.engines.onnx.batch import BatchScheduler
from sessiontape.engines.onnx.demo import PAD
from sessiontape.engines.onnx.folders import model_folder, registry_name
from sessiontape.engines.onnx.model import (
    Concepts,
    GraphSpec,
    Tokenizer,
    chat_format,
    infer_graph,
    load_concepts,
    load_tokenizer,
    model_facts,
    model_origin,
    model_sampling,
    model_sha256,
)
from sessiontape.engines.onnx.options import OnnxOptions
from sessiontape.engines.onnx.runner import (
    CUDA,
    Runner,
    choose_providers,
    open_session,
    preload_cuda,
    quiet_ort,
)
from sessiontape.engines.onnx.static import StaticRunner

log = logging.getLogger("sessiontape.engines.onnx")


@dataclass(frozen=True)
class Opened:
    """A model folder's first session and what the folder says about the model."""

    folder: Path
    #: the onnxruntime module, the providers chosen and the intra-op threads the session has
    ort: Any
    providers: list[str]
    threads: int
    sess: Any
    spec: GraphSpec
    #: the provider the session runs on (its first)
    provider: str
    facts: dict[str, Any]
    vocab: int
    pad: int


@dataclass(frozen=True)
class Served:
    """The runner chosen for the graph's KV layout, and what it leaves of the options."""

    #: the session the runner runs (a CUDA graph session replaces the first one)
    sess: Any
    runner: Runner | StaticRunner
    io_binding: bool
    prefill_chunk: int
    #: the context limit, lowered where a fixed buffer cannot hold it
    limit: int


@dataclass(frozen=True)
class Loaded:
    """Everything the engine serves from: the session, runner, concepts, tokenizer, scheduler and info."""

    folder: Path
    sess: Any
    spec: GraphSpec
    runner: Runner | StaticRunner
    prefill_chunk: int
    concepts: Concepts | None
    tokenizer: Tokenizer
    batch: BatchScheduler | None
    info: EngineInfo


def load_model(o: OnnxOptions) -> Loaded:
    """Open the model of ``o`` and build what serves it; ConfigError for an option it cannot take."""
    m = open_model(o)
    served = choose_runner(m, o, context_limit(m, o))
    concepts = readout_concepts(m, o)
    tokenizer = load_tokenizer(m.folder, m.vocab)
    runner = served.runner
    growing = isinstance(runner, StaticRunner) and not runner.fixed
    slots = batch_slots(o.batch_slots, growing, str(m.facts["attention"]))
    info = engine_info(m, o, served, concepts, slots)
    layers = () if concepts is None else concepts.manifest.layers
    batch = batch_scheduler(m, o, served, slots, layers) if slots else None
    return Loaded(
        folder=m.folder,
        sess=served.sess,
        spec=m.spec,
        runner=runner,
        prefill_chunk=served.prefill_chunk,
        concepts=concepts,
        tokenizer=tokenizer,
        batch=batch,
        info=info,
    )


def open_model(o: OnnxOptions) -> Opened:
    """Find the model folder, open its session and read the vocabulary size and padding token."""
    ort = quiet_ort()
    preload_cuda(ort, o.providers)
    chosen = choose_providers(o.providers)
    folder = model_folder(o.model, o.model_dir, o.size, o.dtype, import_attention(o, chosen))
    path = folder / "model.onnx"
    if not path.exists():
        raise ConfigError(f"no model.onnx in {folder}")
    # onnxruntime's own default counts physical cores, which leaves half of a hyper-threaded VM idle
    threads = (os.cpu_count() or 1) if o.intra_op_threads is None else o.intra_op_threads
    sess = open_session(str(path), chosen, threads, o.inter_op_threads, o.spinning)
    spec = infer_graph(sess.get_inputs(), sess.get_outputs())
    provider = str(sess.get_providers()[0])
    facts = model_facts(folder)
    vocab = spec.vocab_size or facts["vocab_size"]
    if not vocab:
        raise EngineError(
            "cannot tell the vocabulary size: logits has a symbolic last dimension "
            "and config.json names no vocab_size"
        )
    pad = facts["pad_token_id"]
    if pad is None or not 0 <= pad < int(vocab):
        pad = min(PAD, int(vocab) - 1)
    return Opened(folder, ort, chosen, threads, sess, spec, provider, facts, int(vocab), pad)


def import_attention(o: OnnxOptions, providers: Sequence[str]) -> str:
    """The attention a model is imported with: the option's, or for ``auto`` ``masked`` where
    the engine will batch sessions (growing buffers on the CPU, ``batch_slots`` not 0), else
    ``gqa`` (a CUDA provider or a fixed pass shape, where nothing batches).

    With 8 chat users at once, batching makes about twice the tokens a second of one
    session at a time, while a lone session decodes within a few percent of ``gqa``
    (docs/performance.md); where nothing batches, ``gqa``'s one fused kernel is the faster.
    """
    if o.attention != "auto":
        return o.attention
    fixed = bool(providers) and providers[0] == CUDA
    fixed = fixed or o.pass_rows is not None or o.kv_capacity is not None
    return "gqa" if fixed or o.batch_slots == 0 else "masked"


def context_limit(m: Opened, o: OnnxOptions) -> int:
    """The context limit: ``max_length`` when given (within the model's), else the model's."""
    model_max = m.facts["max_length"] or 4096
    if o.max_length is not None and not o.max_length <= model_max:
        raise ConfigError(f"max_length {o.max_length} is outside [1, {model_max}] for this model")
    return o.max_length or model_max


def choose_runner(m: Opened, o: OnnxOptions, limit: int) -> Served:
    """The runner for the graph's KV layout: static buffers, or a concat-layout cache."""
    return _static_runner(m, o, limit) if m.spec.static else _concat_runner(m, o, limit)


def _static_runner(m: Opened, o: OnnxOptions, limit: int) -> Served:
    """A :class:`StaticRunner`: growing buffers, or (on CUDA or when asked) one fixed shape."""
    fixed = m.provider == CUDA or o.pass_rows is not None or o.kv_capacity is not None
    rows = (o.pass_rows or 16) if fixed else None
    capacity = (o.kv_capacity or limit + 1) if fixed else None
    if capacity is not None:  # the demo graph builds slot indices in blocks of SLOT_BLOCK
        capacity = -(-capacity // SLOT_BLOCK) * SLOT_BLOCK
    if capacity is not None:
        # the last slot takes the padding rows' writes; no valid position reaches it
        limit = min(limit, capacity - 1)
        if m.facts["attention"] == "gqa" and rows is not None:
            # GroupQueryAttention places a pass's rows at consecutive positions: the
            # padding rows after the last real one must not clamp at the buffer's end
            limit = min(limit, capacity - rows)
    sess = m.sess
    graph = fixed and m.provider == CUDA and o.cuda_graph is not False
    if graph:
        graph_sess = _cuda_graph_session(m, o)
        graph = graph_sess is not None
        sess = graph_sess if graph_sess is not None else sess
    runner = StaticRunner(
        sess,
        m.spec,
        rows=rows,
        capacity=capacity,
        min_rows=o.min_rows,
        pad_token=m.pad,
        cuda_graph=graph,
    )
    chunk = o.prefill_chunk if rows is None else min(o.prefill_chunk, rows)
    return Served(sess, runner, io_binding=True, prefill_chunk=chunk, limit=limit)


def _cuda_graph_session(m: Opened, o: OnnxOptions) -> Any:
    """The model's session again with CUDA graph capture, or None (logged) where it cannot be had."""
    try:
        return open_session(
            str(m.folder / "model.onnx"),
            m.providers,
            m.threads,
            o.inter_op_threads,
            o.spinning,
            cuda_graph=True,
            fallback=False,
        )
    except EngineError as exc:
        log.warning("no CUDA graph for this model (%s); running passes without one", exc)
        return None


def _concat_runner(m: Opened, o: OnnxOptions, limit: int) -> Served:
    """A :class:`Runner` over a concat-layout cache, which has no fixed shape to set."""
    if o.pass_rows is not None or o.kv_capacity is not None or o.cuda_graph:
        raise ConfigError(
            "pass_rows, kv_capacity and cuda_graph need a static-layout model "
            "(past and present sharing one [batch, kv_heads, capacity, head_dim] buffer)"
        )
    bind = m.provider == CUDA if o.io_binding is None else o.io_binding
    runner = Runner(m.sess, m.spec, io_binding=bind, min_rows=o.min_rows, pad_token=m.pad)
    return Served(m.sess, runner, io_binding=bind, prefill_chunk=o.prefill_chunk, limit=limit)


def readout_concepts(m: Opened, o: OnnxOptions) -> Concepts | None:
    """The readout concepts: ``readout_concepts``, else the folder's file, where the graph has hidden states."""
    cpath = o.readout_concepts or m.folder / "readout_concepts.json"
    if o.readout_concepts and not cpath.exists():
        raise ConfigError(f"readout concepts file {cpath} does not exist")
    if cpath.exists() and m.spec.hidden_layers:
        return load_concepts(cpath, m.spec)
    return None


def batch_slots(batch_slots: int | None, growing: bool, attention: str) -> int:
    """Continuous batching's slot count: 8 by default where it is built, else 0."""
    if attention == "gqa":
        if batch_slots:
            raise ConfigError(
                "batch_slots needs a model imported with --attention masked: ONNX Runtime's CPU "
                "GroupQueryAttention runs a batch only one row per sequence, by another path "
                "than a lone session's, so batched tokens would not be bit-exact (docs/models.md)"
            )
        return 0  # no continuous batching on a GQA graph: see above
    if batch_slots and not growing:
        raise ConfigError(
            "batch_slots needs a static-layout model on growing buffers (the CPU default); "
            "batching the fixed CUDA shape is not built yet"
        )
    return (8 if batch_slots is None else int(batch_slots)) if growing else 0


def engine_info(
    m: Opened, o: OnnxOptions, served: Served, concepts: Concepts | None, slots: int
) -> EngineInfo:
    """The engine's :class:`EngineInfo`: the model's identity and limits, and how it is run."""
    runner = served.runner
    return EngineInfo(
        name="onnx",
        model_id=str(m.facts["model_id"]),
        model_hash=model_sha256(m.folder),
        vocab_size=m.vocab,
        max_length=served.limit,
        eos_token_ids=tuple(m.facts["eos_token_ids"]),
        image_block_tokens=None,
        readout_manifest=None if concepts is None else concepts.manifest,
        chat=chat_format(m.folder),
        origin=model_origin(m.folder),
        sampling=served_sampling(m.folder, o),
        provider=m.provider,
        runtime_version=str(m.ort.__version__),
        extra={
            "model_dir": str(m.folder),
            "providers": list(served.sess.get_providers()),
            "io_binding": served.io_binding,
            "layers": m.spec.layers,
            "kv_heads": m.spec.kv_heads,
            "head_dim": m.spec.head_dim,
            "intra_op_threads": m.threads,
            "spinning": o.spinning,
            "min_rows": runner.min_rows,
            "lookahead": o.lookahead,
            "kv_layout": "static" if m.spec.static else "concat",
            "pass_rows": getattr(runner, "rows", None),
            "kv_capacity": getattr(runner, "capacity", None),
            "cuda_graph": bool(getattr(runner, "cuda_graph", False)),
            "batch_slots": slots,
        },
    )


def served_sampling(folder: Path, o: OnnxOptions) -> ModelSampling:
    """The sampling of a request that names none: the options', else the registry
    entry's the model was named by, else the model's own (engines/models/sampling_defaults.py)."""
    options = o.chosen()
    name = registry_name(o.model, o.model_dir, o.size)
    entry = ModelSampling() if name is None else REGISTRY[name].sampling
    return layered(options, entry, model_sampling(folder))


def batch_scheduler(
    m: Opened, o: OnnxOptions, served: Served, slots: int, readout_layers: tuple[int, ...]
) -> BatchScheduler:
    """The continuous-batching scheduler over ``slots`` KV slots (its thread starts here)."""
    runner = served.runner
    assert isinstance(runner, StaticRunner)
    return BatchScheduler(
        served.sess,
        m.spec,
        slots=slots,
        max_capacity=-(-(served.limit + 1) // SLOT_BLOCK) * SLOT_BLOCK,
        pad_token=m.pad,
        bucket=runner.bucket,
        credit=max(32, o.decode_batch),
        prefill_share=o.batch_prefill_share,
        wait_s=o.batch_wait_s,
        readout_layers=readout_layers,
        single_row=int(m.facts["query_group"]) >= 2,
    )
