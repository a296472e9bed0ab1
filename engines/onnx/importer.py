"""Import a GGUF file or a Hugging Face folder into a model folder the ONNX engine serves.

    sessiontape model import SOURCE --out DIR [--dtype auto|float32|float16|q8|q4]

writes, beside each other::

    model.onnx, model.onnx.data   the graph (engines/onnx/decoder.py) and its weights
    tokenizer.json                the source's tokenizer (rebuilt from GGUF metadata)
    chat_template.jinja           the source's chat template, when it has one
    config.json                   shape, special ids, dtype, and provenance: the source's
                                  sha256, the tokenizer's and the template's sha256
    readout_concepts.json         concept directions for Salience readouts (engines/models/readouts.py)

A model named on the command line or in the config (``--model SOURCE``) is
imported on first use into the model cache (``$SESSIONTAPE_CACHE/models``),
keyed by the source's sha256, the importer's version and the dtype, so a
second start reuses it (:func:`ensure_imported`). An import writes into a
temporary folder and renames it into place when complete, so a crash or a
concurrent import never leaves a half-written model where a server looks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from dataclasses import replace as replace_spec
from pathlib import Path
from typing import Any

from sessiontape.core.errors import UnsupportedModel
from sessiontape.engines.models.registry import REGISTRY, resolve
from sessiontape.engines.models.sources import GgufSource, Source, gguf_parameters, open_source
from sessiontape.engines.onnx.decoder import write_model
from sessiontape.engines.onnx.model import hash_file

log = logging.getLogger("sessiontape.engines.models")

#: bump when the graph or the folder's files change, so caches rebuild
IMPORTER_VERSION = 9
MODEL_TYPE = "sessiontape-import"
#: the graph's attention: one GroupQueryAttention per layer (fastest alone), or separate
#: operators masked by position (continuous batching stays bit-exact)
ATTENTIONS = ("gqa", "masked")


@dataclass(frozen=True)
class Imported:
    folder: Path
    seconds: float
    source_sha256: str


def source_sha256(path: Path) -> str:
    """sha256 of a GGUF file, or of a folder's model files (names and contents, sorted)."""
    h = hashlib.sha256()
    files = (
        [path]
        if path.is_file()
        else sorted(
            p
            for p in path.iterdir()
            if p.is_file() and (p.suffix in (".json", ".safetensors", ".jinja", ".model"))
        )
    )
    for f in files:
        if path.is_dir():
            h.update(f.name.encode() + b"\0")
        hash_file(h, f)
    return h.hexdigest()


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _tokenizer(src: Source) -> tuple[str, Any, str | None]:
    """(tokenizer.json text, specials, chat template source) of ``src``.

    A GGUF without a chat template gets its family's standard one (family_templates.py),
    said in one log line; the template's end-of-turn token stops generation."""
    from tokenizers import Tokenizer

    from sessiontape.engines.models.family_templates import family_of
    from sessiontape.engines.models.tokenizer import (
        tokenizer_from_gguf,
        tokenizer_from_hf,
        with_turn_ends,
    )

    if not isinstance(src, GgufSource):
        text, specials, template = tokenizer_from_hf(src.path)
        return (
            text,
            with_turn_ends(specials, template, Tokenizer.from_str(text).token_to_id),
            template,
        )
    text, specials = tokenizer_from_gguf(src.meta)
    tokens = src.meta.get("tokenizer.ggml.tokens") or []
    ids = {t: i for i, t in enumerate(tokens)}
    given = src.meta.get("tokenizer.chat_template")
    template = str(given) if given else None
    if template is None:
        family = family_of(src.meta, ids)
        if family is not None:
            log.info(
                "%s has no chat template; using the standard %s template",
                src.path.name,
                family.name,
            )
            template = family.template
    return text, with_turn_ends(specials, template, ids.get), template


def _config(src: Source, specials: Any, dtype: str, sha: str, tok: str, tpl: str | None) -> Any:
    spec = src.spec
    facts = asdict(spec)
    facts["rope_scaling"] = None if spec.rope_scaling is None else asdict(spec.rope_scaling)
    return {
        "model_type": MODEL_TYPE,
        "importer_version": IMPORTER_VERSION,
        "model_id": spec.name,
        **facts,
        "kv_heads": spec.kv_heads,
        "vocab_size": spec.vocab,
        "dtype": dtype,
        "eos_token_id": list(specials.eos_ids),
        "bos_token_id": specials.bos_id,
        "pad_token_id": specials.pad_id,
        "bos_token": specials.bos_token,
        "eos_token": specials.eos_token,
        "add_bos_token": bool(specials.add_bos),
        "tokenizer": "tokenizer.json",
        "source": {"kind": src.kind, "name": src.path.name, "sha256": sha},
        "tokenizer_sha256": _sha(tok),
        "chat_template_sha256": None if tpl is None else _sha(tpl),
        #: what the source recommends for requests that name no sampling (sampling_defaults.py)
        "sampling": src.sampling.to_json(),
    }


#: x86 flags of a CPU whose int8 dot products do not saturate (VNNI)
_VNNI = ("avx512_vnni", "avx_vnni")


def accuracy_level(cpu_flags: str | None = None) -> int:
    """MatMulNBits' ``accuracy_level`` for blocks kept as they are: 4 (int8 activations,
    the CPU's fast path) where int8 products are exact, 1 (float activations) on an
    x86 CPU without VNNI.

    On an AVX2-only x86 CPU (onnxruntime 1.31.1) level 4 makes the default SmolLM2
    import answer nonsense to every question, greedy included, where the same path on
    a CPU with VNNI answers them; with the graph's level set to 0 the France prompt gives
    "The capital of France is Paris." (AVX2 has no int8 dot product without 16-bit
    intermediate sums, the likely cause). ``cpu_flags``: /proc/cpuinfo's flags (read when None; a
    machine without it keeps level 4)."""
    if cpu_flags is None:
        try:
            cpu_flags = Path("/proc/cpuinfo").read_text()
        except OSError:
            return 4
    flags = set(cpu_flags.split())
    if "avx2" not in flags and "avx512f" not in flags:
        return 4  # not an x86 CPU whose int8 path is known to drift
    return 4 if any(f in flags for f in _VNNI) else 1


#: ``auto`` imports a GGUF's blocks as float32 on a CPU without exact int8 products
#: (:func:`accuracy_level` 1) where float32 weights take at most this much
FLOAT_AUTO_MAX_BYTES = 4 << 30


def import_dtype(dtype: str, source: Path, cpu_flags: str | None = None) -> str:
    """The dtype a server imports ``source`` with (:func:`ensure_imported`): ``dtype``,
    except that ``auto`` holds a GGUF file's weights as float32 (dequantized exactly) on a
    CPU where :func:`accuracy_level` is 1, when they take at most
    :data:`FLOAT_AUTO_MAX_BYTES` so. (``sessiontape model import --dtype auto`` writes
    the blocks wherever it runs: a folder is served as it is, on any CPU.)

    There MatMulNBits computes 4-bit blocks with float activations by unpacking the
    weights on every call, several times slower than float32 weights (MLAS's float
    kernels), which give the same answers. A larger model keeps its blocks, so that it fits in memory."""
    if dtype != "auto" or accuracy_level(cpu_flags) == 4 or not source.is_file():
        return dtype
    if gguf_parameters(source) * 4 > FLOAT_AUTO_MAX_BYTES:
        return dtype
    return "float32"


def import_model(
    source: Path,
    out: Path,
    dtype: str = "auto",
    *,
    concepts: bool = True,
    replace: bool = True,
    name: str | None = None,
    attention: str = "gqa",
) -> Imported:
    """Import ``source`` into the folder ``out``.

    An existing ``out`` is replaced, or with ``replace=False`` kept (another
    process finished the same import first) and this import's files dropped.
    ``name`` is the served model id (default: the file's stem or the folder's name);
    ``attention`` the graph's attention (``gqa`` or ``masked``, engines/onnx/decoder.py).
    """
    if attention not in ATTENTIONS:
        raise UnsupportedModel(
            f"unknown attention {attention!r}; choose one of {', '.join(ATTENTIONS)}"
        )
    t0 = time.perf_counter()
    src = open_source(source, dtype)
    src.spec = replace_spec(
        src.spec,
        name=name or (source.stem if source.is_file() else source.name),
        attention=attention,
        accuracy_level=accuracy_level(),
    )
    sha = source_sha256(source)
    tok, specials, template = _tokenizer(src)
    if src.spec.vocab <= 0:
        raise UnsupportedModel(f"{source}: the vocabulary size is unknown")
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        write_model(src.spec, src.weight, work)
        (work / "tokenizer.json").write_text(tok)
        if template is not None:
            (work / "chat_template.jinja").write_text(template)
        cfg = _config(src, specials, dtype, sha, tok, template)
        (work / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        if concepts:
            from sessiontape.engines.models.readouts import DEFAULT_EXAMPLES, write_concepts

            write_concepts(work, DEFAULT_EXAMPLES)
        if replace and out.exists():
            shutil.rmtree(out)
        try:
            os.replace(work, out)
        except OSError:
            if not (out / "model.onnx").is_file():
                raise
            shutil.rmtree(work, ignore_errors=True)  # a concurrent import finished first
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return Imported(out, time.perf_counter() - t0, sha)


def cache_folder(dtype: str, sha: str, attention: str = "gqa") -> Path:
    from sessiontape.engines.onnx.demo import cache_root

    # the accuracy level depends on the CPU: a cache carried to another machine imports again
    level = accuracy_level()
    return (
        cache_root() / "imported" / f"{sha[:16]}-{dtype}-{attention}-a{level}-v{IMPORTER_VERSION}"
    )


def ensure_imported(model: str, dtype: str = "auto", attention: str = "gqa") -> Path:
    """The served folder for ``model`` (a registry name, a GGUF file, a Hugging Face folder
    or an imported folder), importing it into the cache on first use."""
    path = resolve(model)
    if path.is_dir() and (path / "model.onnx").is_file():
        return path
    if not path.exists():
        raise UnsupportedModel(f"model {model!r}: {path} does not exist")
    # refuse what cannot be served from the header alone, before hashing the whole file
    open_source(path, dtype)
    sha = source_sha256(path)
    dtype = import_dtype(dtype, path)
    folder = cache_folder(dtype, sha, attention)
    if (folder / "model.onnx").is_file():
        return folder
    log.info("importing %s (%s) into %s", path, dtype, folder)
    done = import_model(
        path,
        folder,
        dtype,
        replace=False,
        name=model if model in REGISTRY else None,
        attention=attention,
    )
    log.info("imported %s in %.1fs", path.name, done.seconds)
    return folder
