"""GGUF's tensor formats: exact dequantization, and the graph's :class:`QuantMatrix` where it fits.

Every block format decodes to integer values ``v`` in sub-blocks of ``g`` weights, each
sub-block with a float32 ``scale`` and, for some formats, a ``bias``:
``w = scale * v (+ bias or - bias)``, in the float32 operations and order the ``gguf``
package's ``dequantize`` uses, so :func:`dequantize` equals it bit for bit::

    type    bytes/256 w  v            g   scale          bias         kept as (bits, block)
    Q4_0    144          q - 8        32  d              -            4, 32  exact
    Q4_1    160          q            32  d              + m          4, 32  offset m + 8d
    Q5_0    176          q - 16       32  d              -            8, 32  exact
    Q5_1    192          q            32  d              + m          8, 32  exact
    Q8_0    272          q (int8)     32  d              -            8, 32  exact
    Q2_K    84           q (2 bits)   16  d * sc         - dmin * m   4, 16  exact
    Q3_K    110          q - 4h (3b)  16  d * (sc - 32)  -            4, 16  exact
    Q4_K    144          q (4 bits)   32  d * sc         - dmin * m   4, 32  offset -dmin*m + 8*scale
    Q5_K    176          q (5 bits)   32  d * sc         - dmin * m   8, 32  exact
    Q6_K    210          q - 32       16  d * sc (int8)  -            8, 16  exact
    IQ4_NL  144          table[q]     32  d              -            8, 32  exact
    IQ4_XS  136          table[q]     32  d * (sc - 32)  -            8, 32  exact

(d, dmin, m: float16 fields of a block; sc and m in the K formats: 4- or 6-bit sub-block
scales and mins; ``table``: IQ4_NL's 16 non-linear levels, -127..113.)

ONNX Runtime's ``MatMulNBits`` computes ``scale * (code - 2 ** (bits - 1))`` per block, and
the builder adds a float offset per block (``offsets``, engines/weights.py). A format
whose values fit ``bits`` around that zero point is kept with ``code = v + 2 ** (bits - 1)``
and ``offsets = bias``: the weights the graph holds are exactly those of :func:`dequantize`.
Q4_1 and Q4_K hold unsigned 4-bit values with a subtracted min; they are kept as 4 bits
with ``code = v`` and ``offsets = bias + 8 * scale``, one float32 rounding per block
(a few ulp of the block's magnitude; the Q4_1 bound is in the tests). The 5- and 6-bit
formats and the IQ4 formats' table (int8 levels) take 8-bit codes, exactly; Q2_K and Q3_K fit 4
bits. ``to_matrix(..., bits=8)`` holds any format as ``code = v + 128`` with
``offsets = bias``, exactly (the embedding, and a head tied to it). F32, F16 and BF16 are
float tensors. Any other type is refused by name (:func:`check_types`).

:func:`quantize` makes blocks from float weights (Hugging Face checkpoints with
``--dtype q4|q8``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from gguf import GGMLQuantizationType as T

from sessiontape.core.errors import UnsupportedModel
from sessiontape.engines.weights import F32, U8, QuantMatrix

BLOCK = 32
I8 = npt.NDArray[np.int8]
#: GGML type ids of the formats this module reads
F32_, F16_, BF16_ = int(T.F32), int(T.F16), int(T.BF16)
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = int(T.Q4_0), int(T.Q4_1), int(T.Q5_0), int(T.Q5_1), int(T.Q8_0)
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = int(T.Q2_K), int(T.Q3_K), int(T.Q4_K), int(T.Q5_K), int(T.Q6_K)
IQ4_NL, IQ4_XS = int(T.IQ4_NL), int(T.IQ4_XS)
FLOATS = (F32_, F16_, BF16_)
IQ4_NL_LEVELS = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8
)


@dataclass(frozen=True)
class Decoded:
    """A block format's rows as ``scale * v (+ / -) bias`` per sub-block of ``v.shape[-1]``."""

    v: I8  # [n_sub_blocks, g] integer values
    scale: F32  # [n_sub_blocks]
    bias: F32 | None  # [n_sub_blocks]
    subtract: bool  # w = scale * v - bias (else + bias)


@dataclass(frozen=True)
class Format:
    name: str
    values: int  # weights per block
    size: int  # bytes per block
    decode: Callable[[U8], Decoded]  # blocks [n, size] -> their sub-blocks
    bits: int  # MatMulNBits' width when kept
    shift: int  # code = v + shift


def _f16(blocks: U8, at: int) -> F32:
    """The float16 field at byte ``at`` of each block, as float32 [n]."""
    return np.ascontiguousarray(blocks[:, at : at + 2]).view(np.float16)[:, 0].astype(np.float32)


def _low_high(qs: U8) -> U8:
    """Bytes [n, c, m] -> their low nibbles then their high nibbles [n, c, 2m]."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def _crumbs(qs: U8, width: int) -> U8:
    """Bytes [n, c, m] -> fields of ``width`` bits, lowest first, each shift a run [n, c, 8/width*m]."""
    shifts = np.arange(0, 8, width, dtype=np.uint8)[None, None, :, None]
    fields = (qs[:, :, None, :] >> shifts) & np.uint8((1 << width) - 1)
    return fields.reshape(qs.shape[0], qs.shape[1], -1)


def _bits(qh: U8) -> U8:
    """Bytes [n, m] -> bit j of byte i at [n, j, i] (the K formats' high-bit planes)."""
    planes = np.unpackbits(qh[:, :, None], axis=-1, bitorder="little")  # [n, m, 8]
    return np.ascontiguousarray(planes.transpose(0, 2, 1))


def _sub(v: npt.NDArray[np.integer], g: int) -> I8:
    return np.ascontiguousarray(v.reshape(-1, g).astype(np.int8))


def _q4_0(b: U8) -> Decoded:
    q = _low_high(b[:, None, 2:18])
    return Decoded(_sub(q.astype(np.int8) - np.int8(8), 32), _f16(b, 0), None, False)


def _q4_1(b: U8) -> Decoded:
    return Decoded(_sub(_low_high(b[:, None, 4:20]), 32), _f16(b, 0), _f16(b, 2), False)


def _five_bits(qh: U8, qs: U8) -> U8:
    high = np.unpackbits(qh, axis=-1, bitorder="little")  # bit j of the u32 -> value j
    return _low_high(qs[:, None, :])[:, 0] | (high << np.uint8(4))


def _q5_0(b: U8) -> Decoded:
    q = _five_bits(b[:, 2:6], b[:, 6:22])
    return Decoded(_sub(q.astype(np.int8) - np.int8(16), 32), _f16(b, 0), None, False)


def _q5_1(b: U8) -> Decoded:
    return Decoded(_sub(_five_bits(b[:, 4:8], b[:, 8:24]), 32), _f16(b, 0), _f16(b, 2), False)


def _q8_0(b: U8) -> Decoded:
    return Decoded(np.ascontiguousarray(b[:, 2:34]).view(np.int8), _f16(b, 0), None, False)


def _q2_k(b: U8) -> Decoded:
    sc = b[:, 0:16]
    q = _crumbs(b[:, 16:80].reshape(-1, 2, 32), 2)  # [n, 2, 128]
    d, dmin = _f16(b, 80)[:, None], _f16(b, 82)[:, None]
    scale = d * (sc & np.uint8(0x0F)).astype(np.float32)
    bias = dmin * (sc >> np.uint8(4)).astype(np.float32)
    return Decoded(_sub(q, 16), scale.reshape(-1), bias.reshape(-1), True)


def _q3_k(b: U8) -> Decoded:
    low = _crumbs(b[:, 32:96].reshape(-1, 2, 32), 2).reshape(-1, 256)
    high = _bits(b[:, 0:32]).reshape(-1, 256)  # bit s of hmask[i] -> value 32s + i
    q = low.astype(np.int8) - ((high ^ np.uint8(1)) << np.uint8(2)).astype(np.int8)
    s = b[:, 96:108]
    lo = _crumbs(s[:, None, 0:8], 4).reshape(-1, 16)
    hi = _crumbs(s[:, None, 8:12], 2).reshape(-1, 16)
    sc = ((lo | (hi << np.uint8(4))).astype(np.int8) - np.int8(32)).astype(np.float32)
    scale = _f16(b, 108)[:, None] * sc
    return Decoded(_sub(q, 16), scale.reshape(-1), None, False)


def _k_scales(b: U8) -> tuple[F32, F32]:
    """Q4_K and Q5_K: (d * sc, dmin * m) of the 8 sub-blocks [n, 8] from bytes 0..15."""
    s = b[:, 4:16].reshape(-1, 3, 4)
    lo, mn, both = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([lo & 0x3F, (both & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    m = np.concatenate([mn & 0x3F, (both >> 4) | ((mn >> 2) & 0x30)], axis=-1)
    d, dmin = _f16(b, 0)[:, None], _f16(b, 2)[:, None]
    return d * sc.astype(np.float32), dmin * m.astype(np.float32)


def _q4_k(b: U8) -> Decoded:
    q = _low_high(b[:, 16:144].reshape(-1, 4, 32))  # [n, 4, 64]: sub-blocks 2g, 2g + 1
    scale, bias = _k_scales(b)
    return Decoded(_sub(q, 32), scale.reshape(-1), bias.reshape(-1), True)


def _q5_k(b: U8) -> Decoded:
    low = _low_high(b[:, 48:176].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    q = low | (_bits(b[:, 16:48]) << np.uint8(4))
    scale, bias = _k_scales(b)
    return Decoded(_sub(q, 32), scale.reshape(-1), bias.reshape(-1), True)


def _q6_k(b: U8) -> Decoded:
    low = _low_high(b[:, 0:128].reshape(-1, 2, 64))  # [n, 2, 128]
    high = _crumbs(b[:, 128:192].reshape(-1, 2, 32), 2)  # [n, 2, 128]
    q = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    scale = _f16(b, 208)[:, None] * sc
    return Decoded(_sub(q, 16), scale.reshape(-1), None, False)


def _iq4_nl(b: U8) -> Decoded:
    q = IQ4_NL_LEVELS[_low_high(b[:, None, 2:18])]
    return Decoded(_sub(q, 32), _f16(b, 0), None, False)


def _iq4_xs(b: U8) -> Decoded:
    lo = b[:, 4:8]  # sub-block 2j: low nibble of byte j, 2j + 1: its high nibble
    low = np.stack([lo & np.uint8(0x0F), lo >> np.uint8(4)], axis=-1).reshape(-1, 8)
    high = np.ascontiguousarray(b[:, 2:4]).view(np.uint16)  # [n, 1]: 2 bits per sub-block
    high = (high >> np.arange(0, 16, 2, dtype=np.uint16)[None, :]).astype(np.uint8) & np.uint8(3)
    sc = ((low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)).astype(np.float32)
    q = IQ4_NL_LEVELS[_low_high(b[:, 8:136].reshape(-1, 8, 16))]  # [n, 8, 32]
    return Decoded(_sub(q, 32), (_f16(b, 0)[:, None] * sc).reshape(-1), None, False)


FORMATS: dict[int, Format] = {
    Q4_0: Format("Q4_0", 32, 18, _q4_0, 4, 8),
    Q4_1: Format("Q4_1", 32, 20, _q4_1, 4, 0),
    Q5_0: Format("Q5_0", 32, 22, _q5_0, 8, 128),
    Q5_1: Format("Q5_1", 32, 24, _q5_1, 8, 128),
    Q8_0: Format("Q8_0", 32, 34, _q8_0, 8, 128),
    Q2_K: Format("Q2_K", 256, 84, _q2_k, 4, 8),
    Q3_K: Format("Q3_K", 256, 110, _q3_k, 4, 8),
    Q4_K: Format("Q4_K", 256, 144, _q4_k, 4, 0),
    Q5_K: Format("Q5_K", 256, 176, _q5_k, 8, 128),
    Q6_K: Format("Q6_K", 256, 210, _q6_k, 8, 128),
    IQ4_NL: Format("IQ4_NL", 32, 18, _iq4_nl, 8, 128),
    IQ4_XS: Format("IQ4_XS", 256, 136, _iq4_xs, 8, 128),
}
#: bytes per block of each block format (kept for callers that size raw tensors)
BLOCK_BYTES = {t: f.size for t, f in FORMATS.items()}
NAMES = {t: f.name for t, f in FORMATS.items()} | {F32_: "F32", F16_: "F16", BF16_: "BF16"}
#: every type :func:`dequantize` reads
SUPPORTED = (*FLOATS, *FORMATS)


def check_types(types: Iterable[tuple[str, int, str]], what: str) -> None:
    """Refuse a file holding a tensor type not in :data:`SUPPORTED`: ``(tensor, id, name)``."""
    missing: dict[str, str] = {}
    for tensor, type_id, name in types:
        if type_id not in SUPPORTED:
            missing.setdefault(name, tensor)
    if missing:
        served = ", ".join(NAMES[t] for t in SUPPORTED)
        found = ", ".join(f"{n} (e.g. {t!r})" for n, t in missing.items())
        raise UnsupportedModel(f"{what}: tensor type {found} is not supported (served: {served})")


def _blocks(raw: npt.NDArray[np.generic], fmt: Format) -> tuple[int, U8]:
    """(rows, blocks [rows * blocks per row, size]) of a raw [rows, bytes] tensor."""
    raw8 = np.ascontiguousarray(raw).view(np.uint8)
    if raw8.ndim == 1:
        raw8 = raw8[None, :]
    raw8 = raw8.reshape(-1, raw8.shape[-1])
    if raw8.shape[1] % fmt.size:
        raise UnsupportedModel(f"a {fmt.name} tensor of byte shape {raw.shape} is not whole blocks")
    return raw8.shape[0], raw8.reshape(-1, fmt.size)


def _format(ggml_type: int) -> Format:
    fmt = FORMATS.get(ggml_type)
    if fmt is None:
        raise UnsupportedModel(f"GGML type {NAMES.get(ggml_type, ggml_type)} is not a block format")
    return fmt


def _floats(raw: npt.NDArray[np.generic], ggml_type: int) -> F32:
    a = np.asarray(raw)
    rows = a.shape[0] if a.ndim > 1 else 1
    if ggml_type == BF16_:
        bits = np.ascontiguousarray(a).view(np.uint16).astype(np.uint32) << np.uint32(16)
        return bits.view(np.float32).reshape(rows, -1)
    dt = np.float32 if ggml_type == F32_ else np.float16
    return np.ascontiguousarray(a).view(dt).astype(np.float32).reshape(rows, -1)


def dequantize(raw: npt.NDArray[np.generic], ggml_type: int) -> F32:
    """A raw GGUF tensor [rows, bytes] (floats as they are) as float32 [rows, cols], as
    ``gguf.quants.dequantize`` gives it, bit for bit."""
    if ggml_type in FLOATS:
        return _floats(raw, ggml_type)
    fmt = _format(ggml_type)
    rows, blocks = _blocks(raw, fmt)
    dec = fmt.decode(blocks)
    w = dec.scale[:, None] * dec.v.astype(np.float32)
    if dec.bias is not None:
        w = w - dec.bias[:, None] if dec.subtract else w + dec.bias[:, None]
    return w.reshape(rows, -1).astype(np.float32, copy=False)


def _pack4(codes: U8) -> U8:
    """4-bit codes in value order [..., 32] -> MatMulNBits bytes [..., 16] (2j low, 2j + 1 high)."""
    return (codes[..., 0::2] | (codes[..., 1::2] << np.uint8(4))).astype(np.uint8)


def to_matrix(raw: npt.NDArray[np.generic], ggml_type: int, bits: int | None = None) -> QuantMatrix:
    """Raw GGUF blocks [rows, bytes] as a :class:`QuantMatrix` (n = rows), as the table in
    the module's docstring says: exact, or (Q4_1, Q4_K) one float32 rounding of the offsets.

    ``bits=8`` holds a 4-bit format in 8-bit codes ``v + 128`` instead, its offsets the
    bias itself: exact for every format (an embedding, read by GatherBlockQuantized)."""
    fmt = _format(ggml_type)
    bits = bits or fmt.bits
    if bits < fmt.bits or bits not in (4, 8):
        raise ValueError(f"{fmt.name} does not fit {bits}-bit codes")
    rows, blocks = _blocks(raw, fmt)
    dec = fmt.decode(blocks)
    g = dec.v.shape[-1]
    half = 1 << (bits - 1)
    shift = fmt.shift if bits == fmt.bits else half
    # v + shift lies in 0 .. 2 ** bits - 1: in uint8 arithmetic (mod 256) it is exact
    codes = (dec.v.view(np.uint8) + np.uint8(shift)).reshape(rows, -1, g)
    scales = dec.scale.reshape(rows, -1)
    offsets = None
    if dec.bias is not None:
        offsets = -dec.bias if dec.subtract else dec.bias.copy()
    if shift != half:
        extra = dec.scale * np.float32(half - shift)
        offsets = extra if offsets is None else offsets + extra
    data = _pack4(codes) if bits == 4 else codes
    return QuantMatrix(
        bits,
        g,
        np.ascontiguousarray(data),
        np.ascontiguousarray(scales, dtype=np.float32),
        None if offsets is None else offsets.reshape(rows, -1).astype(np.float32),
    )


def _reciprocal(d: F32) -> F32:
    """1 / d, and 0 where d is 0 or subnormal (its reciprocal would overflow; the block is ~0)."""
    ok = d >= np.finfo(np.float32).tiny
    return np.where(ok, np.float32(1) / np.where(ok, d, np.float32(1)), np.float32(0)).astype(
        np.float32
    )


def quantize(w: F32, bits: int, block: int = BLOCK) -> QuantMatrix:
    """Float rows [n, k] in blocks: 8 bits symmetric (absmax / 127), 4 bits with a block offset.

    4 bits: ``d = (max - min) / 15``, codes round ``(w - min) / d``, offset
    ``min + 8d`` (GGUF's Q4_1 scheme), which keeps each block's range.
    """
    n, k = w.shape
    if k % block:
        raise UnsupportedModel(
            f"a matrix with {k} inputs does not split into blocks of {block} for {bits}-bit weights"
        )
    x = w.astype(np.float32).reshape(n, k // block, block)
    if bits == 8:
        amax = np.abs(x).max(axis=-1)
        d = (amax / np.float32(127)).astype(np.float32)
        inv = _reciprocal(d)
        q = np.clip(np.rint(x * inv[..., None]), -127, 127).astype(np.int16) + 128
        return QuantMatrix(8, block, q.astype(np.uint8), d)
    if bits != 4:
        raise ValueError(f"bits must be 4 or 8, not {bits}")
    lo, hi = x.min(axis=-1), x.max(axis=-1)
    d = ((hi - lo) / np.float32(15)).astype(np.float32)
    inv = _reciprocal(d)
    codes = np.clip(np.rint((x - lo[..., None]) * inv[..., None]), 0, 15).astype(np.uint8)
    offsets = (lo + np.float32(8) * d).astype(np.float32)
    return QuantMatrix(4, block, _pack4(codes), d, offsets)
