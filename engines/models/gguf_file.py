"""A GGUF file read directly: its header parsed in one pass, its tensor data mapped, not read.

GGUF is llama.cpp's model format (versions 2 and 3, little-endian)::

    "GGUF", version u32, tensor count u64, metadata count u64
    metadata      key (string), value type u32, value
    tensor infos  name (string), n_dims u32, dims u64[n_dims] (fastest first), type u32,
                  offset u64 (from the start of the data)
    padding to ``general.alignment`` (32 by default), then the tensors' data

A string is a u64 byte length and UTF-8 bytes; an array is an item type u32, a u64 count
and the items. Numeric arrays are read with numpy in one call, strings in one tight loop
over the memory-mapped header, so a 262,144-token vocabulary reads in a fraction of a
second (the ``gguf`` package's reader builds a Python object per field part and takes
tens of seconds on such a file). Tensor data is a view of one ``numpy.memmap`` of the
file, made when a tensor is first asked for: opening a file reads only its header.

Everything wrong with a file (cut short, counts or sizes beyond its end, a string that is
not UTF-8, an unknown value type) is :class:`~sessiontape.core.errors.UnsupportedModel`
naming what and where.
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from sessiontape.core.errors import UnsupportedModel

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
#: GGUF value types 0..12 as numpy dtypes (7 bool, 8 string and 9 array are read apart)
_SCALARS: dict[int, np.dtype[Any]] = {
    0: np.dtype("<u1"),
    1: np.dtype("<i1"),
    2: np.dtype("<u2"),
    3: np.dtype("<i2"),
    4: np.dtype("<u4"),
    5: np.dtype("<i4"),
    6: np.dtype("<f4"),
    7: np.dtype("<u1"),
    10: np.dtype("<u8"),
    11: np.dtype("<i8"),
    12: np.dtype("<f8"),
}
BOOL, STRING, ARRAY = 7, 8, 9
#: arrays of arrays nest at most this deep (llama.cpp writes one level)
MAX_NESTING = 4
#: numpy dtypes of the float tensor types, as the ``gguf`` package's reader gives them
_FLOAT_TENSORS: dict[int, np.dtype[Any]] = {
    int(GGMLQuantizationType.F32): np.dtype("<f4"),
    int(GGMLQuantizationType.F16): np.dtype("<f2"),
    int(GGMLQuantizationType.F64): np.dtype("<f8"),
}


@dataclass
class GgufTensor:
    """One tensor's info; ``data`` maps its bytes on first use.

    ``shape`` is numpy's order (slowest first, the reverse of GGUF's dims). ``data`` is an
    array of that shape for float types (F32, F16), and for block formats (and BF16) the raw
    bytes ``[..., bytes per row]``, as ``gguf.GGUFReader`` gives them.
    """

    name: str
    dims: tuple[int, ...]
    type_id: int
    offset: int  # from the start of the file
    nbytes: int
    _file: GgufFile = field(repr=False)

    @property
    def tensor_type(self) -> GGMLQuantizationType:
        return GGMLQuantizationType(self.type_id)

    @property
    def type_name(self) -> str:
        return type_name(self.type_id)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.dims))

    @property
    def n_elements(self) -> int:
        return math.prod(self.dims)

    @property
    def data(self) -> npt.NDArray[Any]:
        raw = self._file.bytes_at(self.offset, self.nbytes)
        dt = _FLOAT_TENSORS.get(self.type_id)
        if dt is not None:
            return raw.view(dt).reshape(self.shape)
        rows = self.shape[:-1] or (1,)
        return raw.reshape(*rows, -1)


def type_name(type_id: int) -> str:
    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type {type_id}"


def tensor_bytes(dims: tuple[int, ...], type_id: int) -> int:
    """The byte size of a tensor of ``dims`` (GGUF order) in type ``type_id``."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    if not dims or dims[0] % block:
        raise ValueError(f"rows of {dims[0] if dims else 0} values are not whole blocks of {block}")
    return math.prod(dims) // block * size


class _Cursor:
    """Reads GGUF values from a buffer, checking every length against its end."""

    def __init__(self, buf: mmap.mmap, what: str) -> None:
        self.buf, self.pos, self.end, self.what = buf, 0, len(buf), what

    def fail(self, why: str) -> UnsupportedModel:
        return UnsupportedModel(
            f"{self.what} is not a readable GGUF file: {why} at byte {self.pos}"
        )

    def take(self, n: int) -> int:
        at = self.pos
        if n < 0 or at + n > self.end:
            raise self.fail(f"{n} bytes needed past the end of the file ({self.end} bytes)")
        self.pos = at + n
        return at

    def u32(self) -> int:
        return int(struct.unpack_from("<I", self.buf, self.take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack_from("<Q", self.buf, self.take(8))[0])

    def string(self) -> str:
        n = self.u64()
        at = self.take(n)
        try:
            return self.buf[at : at + n].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"a string that is not UTF-8 ({exc.reason})") from exc

    def value(self, kind: int) -> Any:
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            return self.array(1)
        dt = _SCALARS.get(kind)
        if dt is None:
            raise self.fail(f"unknown value type {kind}")
        v = np.frombuffer(self.buf, dt, 1, self.take(dt.itemsize))[0].item()
        return bool(v) if kind == BOOL else v

    def array(self, depth: int) -> list[Any]:
        kind, count = self.u32(), self.u64()
        if count > self.end - self.pos:  # every item takes at least a byte
            raise self.fail(f"an array of {count} items longer than the file")
        if kind == STRING:
            return self._strings(count)
        if kind == ARRAY:
            if depth >= MAX_NESTING:
                raise self.fail(f"arrays nested more than {MAX_NESTING} deep")
            return [self.array(depth + 1) for _ in range(count)]
        dt = _SCALARS.get(kind)
        if dt is None:
            raise self.fail(f"unknown array item type {kind}")
        at = self.take(count * dt.itemsize)
        items: list[Any] = np.frombuffer(self.buf, dt, count, at).tolist()
        return [bool(v) for v in items] if kind == BOOL else items

    def _strings(self, count: int) -> list[str]:
        buf, pos, end, unpack = self.buf, self.pos, self.end, struct.Struct("<Q").unpack_from
        out: list[str] = []
        append = out.append
        try:
            for _ in range(count):
                n = unpack(buf, pos)[0]
                pos += 8
                if pos + n > end:
                    raise struct.error
                append(buf[pos : pos + n].decode("utf-8"))
                pos += n
        except struct.error:
            self.pos = pos
            raise self.fail("a string array past the end of the file") from None
        except UnicodeDecodeError as exc:
            self.pos = pos
            raise self.fail(f"a string that is not UTF-8 ({exc.reason})") from exc
        self.pos = pos
        return out


class GgufFile:
    """A GGUF file's metadata (``meta``: key -> plain Python value) and tensors (``tensors``).

    Opening reads the header only; :attr:`GgufTensor.data` maps a tensor's bytes when asked.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with path.open("rb") as f:
                size = f.seek(0, 2)
                if size < 24:
                    raise UnsupportedModel(f"{path} is not a readable GGUF file: {size} bytes")
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise UnsupportedModel(f"{path} is not a readable GGUF file: {exc}") from exc
        self._data: np.memmap[Any, np.dtype[np.uint8]] | None = None
        try:
            self._read_header(size)
        finally:
            self._map.close()

    def _read_header(self, size: int) -> None:
        path = self.path
        cur = _Cursor(self._map, str(path))
        if self._map[:4] != MAGIC:
            raise UnsupportedModel(f"{path} is not a GGUF file (no GGUF magic)")
        cur.take(4)
        self.version = cur.u32()
        if self.version not in VERSIONS:
            raise UnsupportedModel(
                f"{path}: GGUF version {self.version} is not supported (read: 2, 3)"
            )
        n_tensors, n_kv = cur.u64(), cur.u64()
        if n_tensors > size or n_kv > size:
            raise cur.fail(f"{n_tensors} tensors and {n_kv} metadata keys in {size} bytes")
        self.meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.meta[key] = cur.value(cur.u32())
        infos = [self._info(cur) for _ in range(n_tensors)]
        align = self.meta.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise cur.fail(f"general.alignment {align!r} is not a power of two")
        self.data_offset = -(-cur.pos // align) * align
        self.tensors: dict[str, GgufTensor] = {}
        for name, dims, type_id, offset in infos:
            self.tensors[name] = self._tensor(name, dims, type_id, offset, align, size)

    def _info(self, cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
        name = cur.string()
        n_dims = cur.u32()
        if not 1 <= n_dims <= 4:
            raise cur.fail(f"tensor {name!r} has {n_dims} dimensions")
        dims = tuple(cur.u64() for _ in range(n_dims))
        return name, dims, cur.u32(), cur.u64()

    def _tensor(
        self, name: str, dims: tuple[int, ...], type_id: int, offset: int, align: int, size: int
    ) -> GgufTensor:
        where = f"{self.path}: tensor {name!r}"
        try:
            nbytes = tensor_bytes(dims, type_id) if type_id in _KNOWN else 0
        except ValueError as exc:
            raise UnsupportedModel(f"{where} ({type_name(type_id)}): {exc}") from exc
        start = self.data_offset + offset
        if offset % align or start + nbytes > size:
            raise UnsupportedModel(
                f"{where} does not fit the GGUF file (bytes {start}..{start + nbytes} of {size})"
            )
        return GgufTensor(name, dims, type_id, start, nbytes, self)

    def bytes_at(self, offset: int, nbytes: int) -> npt.NDArray[np.uint8]:
        if self._data is None:
            self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._data[offset : offset + nbytes]

    def __iter__(self) -> Iterator[GgufTensor]:
        return iter(self.tensors.values())

    def close(self) -> None:
        """Drop the map of the tensor data (arrays already handed out keep it alive)."""
        self._data = None


_KNOWN = {int(t) for t in GGML_QUANT_SIZES}


def read_header(path: Path) -> GgufFile:
    """``path``'s header (metadata and tensor infos), its tensor data left on disk."""
    return GgufFile(path)
