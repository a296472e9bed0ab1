"""Model sources: a GGUF file or a Hugging Face folder, read tensor by tensor.

Each source knows its :class:`ModelSpec` and hands the graph builder its
weights by the builder's names (``embed``, ``l{i}.wq``, ...), converted as the
import's dtype asks (:class:`WeightPolicy`):

- ``auto``: GGUF blocks stay blocks, each format in the MatMulNBits layout that holds
  it (4 or 8 bits, blocks of 16 or 32: the table in :mod:`quant`), so a file that
  mixes formats per tensor (Q4_K_M, Q4_K_S, ...) keeps each tensor's own; float
  tensors stay float32. A Hugging Face checkpoint is imported as float32.
- ``float32``: every weight dequantized (exactly, :func:`quant.dequantize`).
- ``float16``: every weight dequantized as for ``float32``, then held as float16, and the
  graph computes in float16 (:attr:`ModelSpec.float_type`; the KV cache float16 too,
  logits and hidden states cast to float32 at the outputs). For CUDA; the CPU runs it.
- ``q8`` / ``q4``: matrices in 8-bit / 4-bit blocks (a GGUF format that :mod:`quant`
  keeps at that width stays as it is, others are quantized); the embedding in 8-bit
  blocks.

Both formats are memory-mapped, so reading a model costs what one tensor
costs; a GGUF's header is read by :mod:`gguf_file` without touching its tensors.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import numpy as np

from sessiontape.core.errors import UnsupportedModel
from sessiontape.engines.models import quant
from sessiontape.engines.models.arch import (
    VECTORS,
    longrope_from_gguf,
    spec_from_gguf,
    spec_from_hf,
)
from sessiontape.engines.models.gguf_file import GgufFile, GgufTensor
from sessiontape.engines.models.sampling_defaults import gguf_sampling, hf_sampling
from sessiontape.engines.weights import F32, QuantMatrix, Tensor

DTYPES = ("auto", "float32", "float16", "q8", "q4")
#: dtypes whose weights are all dequantized to float (the builder rounds them to the graph's
#: float type)
FLOAT_DTYPES = ("float32", "float16")


@dataclass(frozen=True)
class WeightPolicy:
    """How matrices are stored: ``dtype`` is one of :data:`DTYPES`."""

    dtype: str

    def matrix(self, raw: Any, ggml_type: int | None, rows_float: Callable[[], F32]) -> Tensor:
        """A projection as the builder takes it (float32 [in, out] or a QuantMatrix of its rows)."""
        fmt = quant.FORMATS.get(ggml_type) if ggml_type is not None else None
        if self.dtype in FLOAT_DTYPES:
            return np.ascontiguousarray(rows_float().T)
        if self.dtype == "auto":
            if fmt is not None:
                return quant.to_matrix(np.asarray(raw), int(ggml_type or 0))
            return np.ascontiguousarray(rows_float().T)  # F32, F16, BF16 or a HF tensor
        bits = 8 if self.dtype == "q8" else 4
        if fmt is not None and fmt.bits == bits:
            return quant.to_matrix(np.asarray(raw), int(ggml_type or 0))
        return quant.quantize(rows_float(), bits)

    def embedding(self, raw: Any, ggml_type: int | None, rows_float: Callable[[], F32]) -> Tensor:
        """The token embedding [vocab, hidden]: a GGUF block format as 8-bit blocks, exactly
        (its offsets, where it has them, beside them: the builder gathers the rows from the
        blocks, in 4 bits where the codes fit, and adds the offsets; a tied head keeps the
        blocks); otherwise 8-bit blocks if asked, else float32."""
        if self.dtype in FLOAT_DTYPES:
            return rows_float()
        if ggml_type in quant.FORMATS:
            return quant.to_matrix(np.asarray(raw), int(ggml_type or 0), bits=8)
        if self.dtype in ("q8", "q4"):
            return quant.quantize(rows_float(), 8)
        return rows_float()


def lm_head_from_embedding(embed: Tensor) -> Tensor:
    """Tied embeddings: the output head reads the embedding's rows (a QuantMatrix as it is).

    A float embedding's head is its transposed view: the builder writes it in row-major
    order in the graph's float type, one copy (a float16 head never holds a float32 one).
    """
    if isinstance(embed, QuantMatrix):
        return embed
    return embed.T


_LAYER = re.compile(r"^l(\d+)\.(\w+)$")


class GgufSource:
    """A ``.gguf`` file (llama.cpp's format): its header read, its tensors memory-mapped.

    Opening checks the architecture (:func:`spec_from_gguf`) and every tensor's type
    (:func:`quant.check_types`) from the header alone, so a file this importer cannot
    serve is refused by the name of what it lacks before any weight is read."""

    kind = "gguf"

    def __init__(self, path: Path, dtype: str = "auto") -> None:
        self._file = GgufFile(path)
        self.path = path
        self.meta = self._file.meta
        self._tensors = self._file.tensors
        name = str(self.meta.get("general.name") or path.stem)
        self.spec, self.family = spec_from_gguf(self.meta, name)
        self._permute = self.family.gguf_permute_qk
        quant.check_types(
            ((t.name, t.type_id, t.type_name) for t in self._tensors.values()), path.name
        )
        self.sampling = gguf_sampling(self.meta, path.name)
        if "rope_freqs.weight" in self._tensors:  # Llama 3.1's rope scaling, as llama.cpp keeps it
            self.spec = replace(self.spec, rope_freq_factors=self._rope_factors())
        if "rope_factors_short.weight" in self._tensors:  # Phi-3's long-rope scaling
            short, long = (
                [float(x) for x in self._vector(f"rope_factors_{which}.weight")]
                for which in ("short", "long")
            )
            self.spec = longrope_from_gguf(self.meta, self.spec, short, long)
        self.policy = WeightPolicy(dtype)
        self.spec = replace(self.spec, float_type=float_type(dtype))
        self._embed: Tensor | None = None

    def _raw(self, name: str) -> Any:
        t = self._tensors.get(name)
        if t is None:
            raise UnsupportedModel(f"{self.path.name} has no tensor {name!r}")
        return t

    def _rope_factors(self) -> tuple[float, ...]:
        factors = self._vector("rope_freqs.weight")
        if factors.shape != (self.spec.head_dim // 2,) or not np.all(factors > 0):
            raise UnsupportedModel(
                f"rope_freqs holds {factors.shape} factors, not {self.spec.head_dim // 2} positive"
            )
        return tuple(float(x) for x in factors)

    def _vector(self, name: str) -> F32:
        t = self._raw(name)
        return _float_rows(np.asarray(t.data), t).reshape(-1)

    def _qk_order(self, heads: int) -> np.ndarray[Any, np.dtype[np.int64]]:
        """Row order that undoes llama.cpp's rotary permutation of a Q or K projection."""
        hd = self.spec.head_dim
        return (
            np.arange(heads * hd, dtype=np.int64)
            .reshape(heads, hd // 2, 2)
            .transpose(0, 2, 1)
            .reshape(-1)
        )

    def _matrix(self, name: str, rows: np.ndarray[Any, np.dtype[np.int64]] | None = None) -> Tensor:
        t = self._raw(name)
        ggml = int(t.tensor_type.value)
        raw = np.asarray(t.data)
        if rows is not None:
            raw = raw[rows]
        return self.policy.matrix(raw, ggml, lambda: _float_rows(raw, t))

    def weight(self, name: str) -> Tensor:
        """The builder's weight ``name``."""
        if name == "embed":
            t = self._raw("token_embd.weight")
            self._embed = self.policy.embedding(
                np.asarray(t.data),
                int(t.tensor_type.value),
                lambda: _float_rows(np.asarray(t.data), t),
            )
            return self._embed
        if name == "final_norm":
            return self._vector("output_norm.weight")
        if name == "lm_head":
            if "output.weight" in self._tensors:
                return self._matrix("output.weight")
            return lm_head_from_embedding(
                self._embed if self._embed is not None else self.weight("embed")
            )
        m = _LAYER.match(name)
        names = self.family.gguf
        if m is None or m.group(2) not in names:
            raise UnsupportedModel(f"no GGUF tensor for weight {name!r}")
        i, part = int(m.group(1)), m.group(2)
        gname = f"blk.{i}.{names[part]}"
        if part in VECTORS:
            return self._vector(gname)
        fused = self.family.fused_rows(self.spec, part)
        if fused is not None and f"blk.{i}.{names[fused[0]]}" in self._tensors:
            whole, start, end, total = fused
            fname = f"blk.{i}.{names[whole]}"
            have = int(np.asarray(self._raw(fname).data).shape[0])
            if have != total:
                raise UnsupportedModel(f"{fname} has {have} rows, not {total}")
            return self._matrix(fname, np.arange(start, end, dtype=np.int64))
        rows = None
        if self._permute and part in ("wq", "wk"):
            rows = self._qk_order(self.spec.heads if part == "wq" else self.spec.kv_heads)
        return self._matrix(gname, rows)


def _float_rows(raw: Any, t: GgufTensor) -> F32:
    """GGUF tensor rows (raw blocks or floats) as float32 [rows, cols]."""
    return quant.dequantize(raw, t.type_id)


def gguf_parameters(path: Path) -> int:
    """How many weights a GGUF file holds (its tensors' elements); 0 for a file that is
    not readable GGUF (the import then refuses it with the reason)."""
    try:
        return sum(t.n_elements for t in GgufFile(path))
    except UnsupportedModel:
        return 0


_SAFE_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


class SafetensorsFile:
    """One ``.safetensors`` file, memory-mapped: ``tensor(name)`` as float32.

    The header is checked when the file opens (a JSON object whose tensors'
    byte ranges fit their dtype and shape and lie inside the file), so a cut
    or corrupt file is refused before anything is built.
    """

    def __init__(self, path: Path) -> None:
        size_on_disk = path.stat().st_size
        try:
            with path.open("rb") as f:
                size = int.from_bytes(f.read(8), "little")
                if not 2 <= size <= min(100 << 20, size_on_disk - 8):
                    raise ValueError(f"header size {size}")
                header = json.loads(f.read(size))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
        except (OSError, ValueError) as exc:
            raise UnsupportedModel(f"{path} is not a readable safetensors file: {exc}") from exc
        self.path = path
        self.base = 8 + size
        self.entries: dict[str, Mapping[str, Any]] = {}
        for name, e in header.items():
            if name == "__metadata__":
                continue
            self.entries[name] = self._checked(name, e, size_on_disk - self.base)

    def _checked(self, name: str, e: Any, data_bytes: int) -> Mapping[str, Any]:
        try:
            start, end = (int(x) for x in e["data_offsets"])
            shape = [int(x) for x in e["shape"]]
            width = {"F32": 4, "F16": 2, "BF16": 2}.get(str(e["dtype"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise UnsupportedModel(f"{self.path.name}: tensor {name!r} is malformed") from exc
        need = int(np.prod(shape, dtype=np.int64)) * (width or 0)
        if width is not None and not (0 <= start <= end <= data_bytes and end - start == need):
            raise UnsupportedModel(
                f"{self.path.name}: tensor {name!r} does not fit the file "
                f"(bytes {start}..{end} of {data_bytes}, {need} needed)"
            )
        return cast(Mapping[str, Any], e)

    def tensor(self, name: str) -> F32:
        e = self.entries[name]
        dt = _SAFE_DTYPES.get(str(e["dtype"]))
        if dt is None:
            raise UnsupportedModel(
                f"{self.path.name}: tensor {name!r} is {e['dtype']} (served: F32, F16, BF16)"
            )
        start = int(e["data_offsets"][0])
        shape = tuple(int(x) for x in e["shape"])
        arr = np.memmap(self.path, dtype=dt, mode="r", offset=self.base + start, shape=shape)
        if e["dtype"] == "BF16":
            return (arr.astype(np.uint32) << np.uint32(16)).view(np.float32)
        return np.asarray(arr, dtype=np.float32)


class HfSource:
    """A Hugging Face checkpoint folder: ``config.json`` and ``*.safetensors``."""

    kind = "hf"

    def __init__(self, folder: Path, dtype: str = "auto") -> None:
        cfg_path = folder / "config.json"
        try:
            self.config = json.loads(cfg_path.read_text())
        except (OSError, ValueError) as exc:
            raise UnsupportedModel(f"{folder}: cannot read config.json: {exc}") from exc
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise UnsupportedModel(f"{folder} has no *.safetensors weights")
        self.path = folder
        self._where: dict[str, SafetensorsFile] = {}
        for f in files:
            st = SafetensorsFile(f)
            for name in st.entries:
                self._where[name] = st
        self.spec, self.family, self._tied = spec_from_hf(self.config, folder.name)
        # the language model's tensors: model.*, or a multimodal checkpoint's language_model.*
        embeds = [n for n in self._where if n.endswith("embed_tokens.weight")]
        self._prefix = min(embeds, key=len)[: -len("embed_tokens.weight")] if embeds else "model."
        heads = [n for n in self._where if n.endswith("lm_head.weight")]
        self._head = min(heads, key=len) if heads else "lm_head.weight"
        self.sampling = hf_sampling(folder)
        self.policy = WeightPolicy("float32" if dtype == "auto" else dtype)
        self.spec = replace(self.spec, float_type=float_type(dtype))

    def _rows(self, name: str) -> F32:
        st = self._where.get(name)
        if st is None:
            raise UnsupportedModel(f"{self.path.name} has no tensor {name!r}")
        return st.tensor(name)

    def _norm(self, name: str) -> F32:
        """A norm weight as the graph multiplies by it (Gemma's ``1 + w``, in float32)."""
        w = self._rows(name).reshape(-1)
        shift = self.family.hf_norm_shift
        return w + np.float32(shift) if shift else w

    def weight(self, name: str) -> Tensor:
        p = self._prefix
        if name == "embed":
            return self.policy.embedding(None, None, lambda: self._rows(p + "embed_tokens.weight"))
        if name == "final_norm":
            return self._norm(p + "norm.weight")
        if name == "lm_head":
            if self._tied or self._head not in self._where:
                return lm_head_from_embedding(self.weight("embed"))
            return self.policy.matrix(None, None, lambda: self._rows(self._head))
        m = _LAYER.match(name)
        names = self.family.hf
        if m is None or m.group(2) not in names:
            raise UnsupportedModel(f"no checkpoint tensor for weight {name!r}")
        layer, part = m.group(1), m.group(2)
        hname = f"{p}layers.{layer}.{names[part]}"
        if part in VECTORS:
            return self._norm(hname) if part.endswith("norm") else self._rows(hname).reshape(-1)
        fused = self.family.fused_rows(self.spec, part)
        if fused is not None and f"{p}layers.{layer}.{names[fused[0]]}" in self._where:
            whole, start, end, total = fused
            fname = f"{p}layers.{layer}.{names[whole]}"

            def rows() -> F32:
                full = self._rows(fname)
                if full.shape[0] != total:
                    raise UnsupportedModel(f"{fname} has {full.shape[0]} rows, not {total}")
                return np.ascontiguousarray(full[start:end])

            return self.policy.matrix(None, None, rows)
        return self.policy.matrix(None, None, lambda: self._rows(hname))


Source = GgufSource | HfSource


def float_type(dtype: str) -> str:
    """The graph's float type for an import ``dtype``: float16 for ``float16``, else float32."""
    return "float16" if dtype == "float16" else "float32"


def open_source(path: Path, dtype: str = "auto") -> Source:
    """The source at ``path``: a ``.gguf`` file or a folder with ``config.json``."""
    if dtype not in DTYPES:
        raise UnsupportedModel(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if path.is_file():
        with path.open("rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise UnsupportedModel(f"{path} is not a GGUF file")
        return GgufSource(path, dtype)
    if path.is_dir() and (path / "config.json").is_file():
        return HfSource(path, dtype)
    raise UnsupportedModel(
        f"{path} is neither a .gguf file nor a Hugging Face folder (config.json + *.safetensors)"
    )
