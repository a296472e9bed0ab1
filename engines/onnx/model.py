"""What a decoder-only ONNX model looks like from its graph I/O.

The engine serves any model exported with the common names::

    input_ids, attention_mask, position_ids, past_key_values.N.key|value
    -> logits, present.N.key|value  [, hidden_states.N]

Layers, KV heads, head size and the KV element type are read from the
``past_key_values`` inputs, and the KV layout from their sequence dimension:
when ``present`` has the same one (a fixed size or the same symbol) the model
writes into one static buffer (:mod:`sessiontape.engines.onnx.static`), otherwise it
concatenates (:class:`sessiontape.engines.onnx.runner.Runner`); the vocabulary from the ``logits`` output (or
``config.json`` when that dimension is symbolic). Everything else about the
model folder (tokenizer, EOS ids, context length, readout concepts) is read
here too, so the engine itself only deals with sessions and caches.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from sessiontape.core.engine.interface import ChatFormat, ModelSampling, ReadoutManifest
from sessiontape.core.errors import ConfigError, EngineError
from sessiontape.engines.models.sampling_defaults import checked_sampling

_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
_HIDDEN = re.compile(r"^hidden_states\.(\d+)$")
_DTYPES: dict[str, Any] = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


class _NodeArg(Protocol):
    name: str
    shape: Sequence[int | str | None]
    type: str


@dataclass(frozen=True)
class GraphSpec:
    layers: int
    kv_heads: int
    head_dim: int
    kv_dtype: Any
    vocab_size: int | None
    #: indices N of the ``hidden_states.N`` outputs, sorted
    hidden_layers: tuple[int, ...]
    hidden_size: int | None
    #: past and present are one [batch, kv_heads, capacity, head_dim] buffer written at the
    #: pass's positions (the ``static`` layout), not a cache that grows by concatenation
    static: bool = False

    def kv_bytes_per_position(self) -> int:
        return (
            2 * self.layers * self.kv_heads * self.head_dim * int(np.dtype(self.kv_dtype).itemsize)
        )


def infer_graph(inputs: Sequence[_NodeArg], outputs: Sequence[_NodeArg]) -> GraphSpec:
    """Shape facts from an ORT session's ``get_inputs()`` / ``get_outputs()``.

    Raises EngineError naming what is missing when the model does not follow
    the convention.
    """
    ins = {a.name: a for a in inputs}
    outs = {a.name: a for a in outputs}
    for need in ("input_ids", "attention_mask", "position_ids"):
        if need not in ins:
            raise EngineError(f"model has no {need!r} input (inputs: {sorted(ins)})")
    if "logits" not in outs:
        raise EngineError(f"model has no 'logits' output (outputs: {sorted(outs)})")
    found: dict[int, set[str]] = {}
    for name in ins:
        m = _PAST.match(name)
        if m:
            found.setdefault(int(m.group(1)), set()).add(m.group(2))
    layers = len(found)
    if (
        layers == 0
        or sorted(found) != list(range(layers))
        or any(v != {"key", "value"} for v in found.values())
    ):
        raise EngineError(
            "model inputs past_key_values.N.key|value are missing or not numbered 0..N-1"
        )
    for i in range(layers):
        for kind in ("key", "value"):
            if f"present.{i}.{kind}" not in outs:
                raise EngineError(f"model has no 'present.{i}.{kind}' output")
    first = ins["past_key_values.0.key"]
    shape = list(first.shape)
    if len(shape) != 4 or not isinstance(shape[1], int) or not isinstance(shape[3], int):
        raise EngineError(
            f"past_key_values.0.key must be [batch, kv_heads, past, head_dim] with fixed "
            f"kv_heads and head_dim, not {shape}"
        )
    dtype = _DTYPES.get(first.type)
    if dtype is None:
        raise EngineError(f"unsupported KV element type {first.type}")
    vocab = outs["logits"].shape[-1] if outs["logits"].shape else None
    present_len = list(outs["present.0.key"].shape)[2:3]
    static = present_len == shape[2:3] and shape[2] is not None
    hidden = sorted(int(m.group(1)) for name in outs if (m := _HIDDEN.match(name)))
    hsize = outs[f"hidden_states.{hidden[0]}"].shape[-1] if hidden else None
    return GraphSpec(
        layers=layers,
        kv_heads=int(shape[1]),
        head_dim=int(shape[3]),
        kv_dtype=dtype,
        vocab_size=vocab if isinstance(vocab, int) else None,
        hidden_layers=tuple(hidden),
        hidden_size=hsize if isinstance(hsize, int) else None,
        static=static,
    )


def hash_file(h: Any, path: Path) -> None:
    """Feed ``path``'s bytes to the hash ``h``, a block at a time."""
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)


def model_sha256(folder: Path) -> str:
    """sha256 of ``model.onnx``, followed by its external data file when it has one."""
    h = hashlib.sha256()
    for name in ("model.onnx", "model.onnx.data"):
        if (folder / name).exists():
            hash_file(h, folder / name)
    return h.hexdigest()


def chat_format(folder: Path) -> ChatFormat | None:
    """The model folder's chat template (``chat_template.jinja``) with its BOS and EOS texts."""
    path = folder / "chat_template.jinja"
    if not path.is_file():
        return None
    cfg = read_json(folder / "config.json")
    bos, eos = cfg.get("bos_token"), cfg.get("eos_token")
    return ChatFormat(
        template=path.read_text(),
        bos_token=bos if isinstance(bos, str) else None,
        eos_token=eos if isinstance(eos, str) else None,
    )


def model_origin(folder: Path) -> dict[str, str]:
    """An imported model's provenance from its config.json (empty for other folders)."""
    cfg = read_json(folder / "config.json")
    source = cfg.get("source")
    if not isinstance(source, dict):
        return {}
    out = {"source_sha256": str(source.get("sha256", ""))}
    for key in ("tokenizer_sha256", "chat_template_sha256", "dtype"):
        if cfg.get(key):
            out[key] = str(cfg[key])
    return out


def model_sampling(folder: Path) -> ModelSampling:
    """What an imported model's source recommends for requests that name no sampling
    (config.json's ``sampling``; nothing for other folders)."""
    path = folder / "config.json"
    recommended = read_json(path).get("sampling") or {}
    if not isinstance(recommended, dict):
        raise ConfigError(f"{path}: sampling is not a JSON object")
    return checked_sampling(recommended, f"{path}: sampling")


def read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    return data


def model_facts(folder: Path) -> dict[str, Any]:
    """EOS ids, context length and the model's name from config.json / genai_config.json."""
    cfg = read_json(folder / "config.json")
    genai = read_json(folder / "genai_config.json").get("model", {})
    eos = cfg.get("eos_token_id", genai.get("eos_token_id", ()))
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    max_length = (
        cfg.get("max_length") or cfg.get("max_position_embeddings") or genai.get("context_length")
    )
    name = cfg.get("name")
    heads = cfg.get("heads") or cfg.get("num_attention_heads")
    kv_heads = cfg.get("kv_heads") or cfg.get("num_key_value_heads") or heads
    if cfg.get("model_type") == "sessiontape-demo":
        model_id = f"sessiontape-demo-{name}"
    elif cfg.get("model_type") == "sessiontape-import" and cfg.get("model_id"):
        model_id = str(cfg["model_id"])
    else:
        model_id = folder.name
    pad = cfg.get("pad_token_id")
    return {
        #: ``gqa`` when the graph's attention is one GroupQueryAttention per layer, which places
        #: a pass's rows at consecutive positions (decoder.py)
        "attention": str(cfg.get("attention") or "masked"),
        #: the id padding rows carry (any valid id: their results are dropped)
        "pad_token_id": int(pad) if isinstance(pad, int) else None,
        #: query heads per KV head (1 when config.json does not say)
        "query_group": int(heads) // int(kv_heads) if heads and kv_heads else 1,
        "eos_token_ids": eos_ids,
        "max_length": int(max_length) if max_length else None,
        "vocab_size": cfg.get("vocab_size") or genai.get("vocab_size"),
        "model_id": model_id,
    }


F64 = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Concepts:
    """Unit concept directions per readout layer: ``directions[layer_index]`` is [concepts, hidden]."""

    manifest: ReadoutManifest
    directions: tuple[F64, ...]

    def scores(self, hidden_rows: Sequence[npt.NDArray[Any]]) -> tuple[float, ...]:
        """Cosine of each listed layer's hidden state with each concept, layer-major."""
        out: list[float] = []
        for h, dirs in zip(hidden_rows, self.directions, strict=True):
            v = np.asarray(h, dtype=np.float64)
            norm = float(np.linalg.norm(v))
            out.extend(float(x) for x in (dirs @ v) / (norm if norm > 0 else 1.0))
        return tuple(out)


def load_concepts(path: Path, spec: GraphSpec) -> Concepts:
    """Concept directions from JSON: ``{"concepts": [...], "layers": [...], "directions": [L][C][H]}``."""
    data = read_json(path)
    try:
        concepts = tuple(str(c) for c in data["concepts"])
        layers = tuple(int(x) for x in data["layers"])
        dirs = np.asarray(data["directions"], dtype=np.float64)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(
            f"{path}: readout concepts need 'concepts', 'layers' and 'directions' ({exc})"
        ) from exc
    missing = [x for x in layers if x not in spec.hidden_layers]
    if missing:
        raise ConfigError(f"{path}: layers {missing} have no hidden_states output in the model")
    if spec.hidden_size is None or dirs.shape != (len(layers), len(concepts), spec.hidden_size):
        raise ConfigError(
            f"{path}: directions shape {dirs.shape} is not "
            f"[{len(layers)}, {len(concepts)}, {spec.hidden_size}]"
        )
    norms = np.linalg.norm(dirs, axis=-1, keepdims=True)
    if np.any(norms == 0):
        raise ConfigError(f"{path}: a concept direction is all zeros")
    unit = dirs / norms
    manifest = ReadoutManifest(
        concepts=concepts, layers=layers, hidden_size=int(dirs.shape[2]), dtype="float32"
    )
    return Concepts(manifest, tuple(unit[i] for i in range(len(layers))))


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class HFTokenizer:
    """A ``tokenizer.json`` through the ``tokenizers`` package."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(path))

    def __getstate__(self) -> str:
        # pickled as its JSON (an engine served from a worker process sends its codec over)
        return str(self._tok.to_str())

    def __setstate__(self, state: str) -> None:
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_str(state)

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self._tok.encode(text, add_special_tokens=False).ids]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))


def load_tokenizer(folder: Path, vocab_size: int) -> Tokenizer:
    from sessiontape.engines.byte_tokenizer import ByteTokenizer

    path = folder / "tokenizer.json"
    if path.exists():
        return HFTokenizer(path)
    return ByteTokenizer(vocab_size)
