"""Block-quantized weights: GGUF's Q4_0, Q4_1 and Q8_0, and the graph's :class:`QuantMatrix`.

GGUF stores a matrix as rows of blocks of 32 values along the input dimension:

    Q8_0  34 bytes: d (float16), q[32] (int8)                  w = d * q
    Q4_0  18 bytes: d (float16), 16 bytes of nibbles           w = d * (q - 8)
    Q4_1  20 bytes: d (float16), m (float16), 16 bytes         w = d * q + m

In a 4-bit block, byte j holds value j in its low nibble and value j + 16 in
its high one. ONNX Runtime's ``MatMulNBits`` takes the same blocks with
another nibble order (values 2j and 2j + 1 share byte j) and a default zero
point of 2 ** (bits - 1), so the codes are repacked and nothing is rounded:
Q4_0 maps exactly; Q8_0's signed codes shift by 128; Q4_1's ``d * q + m``
becomes ``d * (q - 8) + (m + 8d)``, the offset kept beside the matrix (see
:mod:`sessiontape.engines.weights`).

:func:`dequantize` turns raw blocks into float32 exactly as the ``gguf``
package's own ``dequantize`` does (the float32 import path and the tests
rely on it bit for bit). :func:`quantize` makes blocks from float weights
(Hugging Face checkpoints with ``--dtype q4|q8``, and GGUF formats that
MatMulNBits cannot hold as they are).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from sessiontape.core.errors import UnsupportedModel
from sessiontape.engines.weights import F32, U8, QuantMatrix

BLOCK = 32
#: GGML type ids and block sizes in bytes of the formats kept as blocks
Q4_0, Q4_1, Q8_0 = 2, 3, 8
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0"}


def _split(raw: U8, ggml_type: int) -> tuple[int, npt.NDArray[np.uint8]]:
    """(rows, blocks [rows, n_blocks, block_bytes]) of a raw [rows, bytes] tensor."""
    size = BLOCK_BYTES[ggml_type]
    rows = raw.shape[0]
    if raw.ndim != 2 or raw.shape[1] % size:
        raise UnsupportedModel(
            f"a {NAMES[ggml_type]} tensor of byte shape {raw.shape} is not whole blocks"
        )
    return rows, raw.reshape(rows, -1, size)


def _f16(blocks: U8, at: int) -> F32:
    return (
        np.ascontiguousarray(blocks[..., at : at + 2]).view(np.float16)[..., 0].astype(np.float32)
    )


def _nibbles(qs: U8) -> U8:
    """GGUF's 4-bit codes in value order: [..., 16 bytes] -> [..., 32] (low nibbles first)."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def dequantize(raw: U8, ggml_type: int) -> F32:
    """Raw GGUF blocks [rows, bytes] as float32 [rows, cols], as ``gguf.quants.dequantize`` gives."""
    rows, blocks = _split(raw, ggml_type)
    d = _f16(blocks, 0)[..., None]
    if ggml_type == Q8_0:
        q = blocks[..., 2:].view(np.int8).astype(np.float32)
        w = d * q
    elif ggml_type == Q4_0:
        q = (_nibbles(blocks[..., 2:]).astype(np.int8) - np.int8(8)).astype(np.float32)
        w = d * q
    elif ggml_type == Q4_1:
        m = _f16(blocks, 2)[..., None]
        w = (d * _nibbles(blocks[..., 4:]).astype(np.float32)) + m
    else:
        raise UnsupportedModel(f"GGML type {ggml_type} is not a block format kept as is")
    return w.reshape(rows, -1).astype(np.float32, copy=False)


def _pack4(codes: U8) -> U8:
    """4-bit codes in value order [..., 32] -> MatMulNBits bytes [..., 16] (2j low, 2j + 1 high)."""
    return (codes[..., 0::2] | (codes[..., 1::2] << np.uint8(4))).astype(np.uint8)


def to_matrix(raw: U8, ggml_type: int) -> QuantMatrix:
    """Raw GGUF blocks [rows, bytes] as a :class:`QuantMatrix` (n = rows), without rounding."""
    _, blocks = _split(raw, ggml_type)
    d = _f16(blocks, 0)
    if ggml_type == Q8_0:
        codes = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return QuantMatrix(8, BLOCK, np.ascontiguousarray(codes), d)
    if ggml_type == Q4_0:
        return QuantMatrix(4, BLOCK, _pack4(_nibbles(blocks[..., 2:])), d)
    if ggml_type == Q4_1:
        m = _f16(blocks, 2)
        offsets = (m + np.float32(8) * d).astype(np.float32)
        return QuantMatrix(4, BLOCK, _pack4(_nibbles(blocks[..., 4:])), d, offsets)
    raise UnsupportedModel(f"GGML type {ggml_type} is not a block format kept as is")


def widen(m: QuantMatrix) -> QuantMatrix:
    """A 4-bit matrix without offsets as the same values in 8-bit blocks (for GatherBlockQuantized)."""
    if m.bits == 8:
        return m
    if m.offsets is not None:
        raise ValueError("only a matrix without offsets widens exactly")
    codes = m.codes().astype(np.uint16) + 120  # (c - 8) + 128
    return QuantMatrix(8, m.block, codes.astype(np.uint8).reshape(m.n, -1, m.block), m.scales)


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
