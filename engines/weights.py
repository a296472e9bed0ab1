"""Weights as the graph builder takes them: float32 ``[in, out]`` matrices or 4/8-bit blocks.

A :class:`QuantMatrix` holds ``MatMulNBits``' layout (engines/onnx/decoder.py
runs it); :func:`concat_out` and :func:`scale_out` fuse and scale matrices
along their outputs without leaving the blocks (q, k, v -> qkv; gate, up).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]


@dataclass
class QuantMatrix:
    """A matrix of ``n`` output rows in blocks of ``block`` along its ``k`` inputs (MatMulNBits' layout).

    ``w[r, c] = scales[r, c // block] * (q[r, c] - 2 ** (bits - 1)) + offsets[r, c // block]``,
    with ``q`` packed in ``data`` [n, k / block, block * bits / 8] (4 bits: element 2j in
    the low nibble of byte j, 2j + 1 in the high one). ``offsets`` is None when zero.
    """

    bits: int
    block: int
    data: U8
    scales: F32
    offsets: F32 | None = None
    n: int = field(init=False)
    k: int = field(init=False)

    def __post_init__(self) -> None:
        n, blocks, blob = self.data.shape
        if blob * 8 != self.block * self.bits or self.scales.shape != (n, blocks):
            raise ValueError(
                f"quantized matrix data {self.data.shape} and scales {self.scales.shape} do not "
                f"fit {self.bits}-bit blocks of {self.block}"
            )
        if self.offsets is not None and self.offsets.shape != self.scales.shape:
            raise ValueError("quantized matrix offsets must have the scales' shape")
        self.n, self.k = n, blocks * self.block

    def codes(self) -> U8:
        """The unpacked codes ``q`` [n, k]."""
        if self.bits == 8:
            return self.data.reshape(self.n, self.k)
        lo, hi = self.data & 0x0F, self.data >> 4
        return np.stack([lo, hi], axis=-1).reshape(self.n, self.k)

    def dequantize(self) -> F32:
        """The matrix as float32 [n, k] (``[out, in]``)."""
        q = self.codes().reshape(self.n, -1, self.block).astype(np.float32)
        w = (q - np.float32(1 << (self.bits - 1))) * self.scales[:, :, None]
        if self.offsets is not None:
            w = w + self.offsets[:, :, None]
        return w.reshape(self.n, self.k).astype(np.float32)

    def take_rows(self, rows: npt.NDArray[np.int64]) -> QuantMatrix:
        return QuantMatrix(
            self.bits,
            self.block,
            np.ascontiguousarray(self.data[rows]),
            np.ascontiguousarray(self.scales[rows]),
            None if self.offsets is None else np.ascontiguousarray(self.offsets[rows]),
        )

    def scaled(self, factor: float) -> QuantMatrix:
        f = np.float32(factor)
        return QuantMatrix(
            self.bits,
            self.block,
            self.data,
            (self.scales * f).astype(np.float32),
            None if self.offsets is None else (self.offsets * f).astype(np.float32),
        )


Tensor = F32 | QuantMatrix
#: hands out a weight by name; each is asked for once, in the order the graph needs it
Weights = Callable[[str], Tensor]


def relayout(m: QuantMatrix, bits: int, block: int) -> QuantMatrix:
    """The same values in ``bits``-bit blocks of ``block`` (``bits`` >= ``m.bits``, ``block``
    dividing ``m.block``): codes recentred on the wider zero point, scales and offsets
    repeated per smaller block. Exact."""
    if bits < m.bits or m.block % block:
        raise ValueError(
            f"{m.bits}-bit blocks of {m.block} do not fit {bits}-bit blocks of {block}"
        )
    if (bits, block) == (m.bits, m.block):
        return m
    shift = (1 << (bits - 1)) - (1 << (m.bits - 1))
    codes = (m.codes().astype(np.uint16) + shift).astype(np.uint8)
    if bits == 4:
        codes = codes[:, 0::2] | (codes[:, 1::2] << np.uint8(4))
    per = m.block // block
    return QuantMatrix(
        bits,
        block,
        np.ascontiguousarray(codes.reshape(m.n, m.k // block, -1)),
        np.repeat(m.scales, per, axis=1),
        None if m.offsets is None else np.repeat(m.offsets, per, axis=1),
    )


def concat_out(parts: list[Tensor]) -> Tensor:
    """Matrices side by side along their outputs (q, k, v -> qkv; gate, up -> gate_up).

    Blocks of different widths or sizes (a GGUF's per-tensor mix, as in Q4_K_M) are
    brought to the widest bits and the smallest block first (:func:`relayout`, exact)."""
    if all(isinstance(p, QuantMatrix) for p in parts):
        qs = [p for p in parts if isinstance(p, QuantMatrix)]
        if len({p.k for p in qs}) == 1:
            bits, block = max(p.bits for p in qs), min(p.block for p in qs)
            if all(p.block % block == 0 for p in qs):
                qs = [relayout(p, bits, block) for p in qs]
        if len({(p.bits, p.block, p.k) for p in qs}) == 1:
            offsets = None
            if any(p.offsets is not None for p in qs):
                offsets = np.concatenate(
                    [p.offsets if p.offsets is not None else np.zeros_like(p.scales) for p in qs]
                )
            return QuantMatrix(
                qs[0].bits,
                qs[0].block,
                np.concatenate([p.data for p in qs]),
                np.concatenate([p.scales for p in qs]),
                offsets,
            )
    dense = [p.dequantize().T if isinstance(p, QuantMatrix) else p for p in parts]
    return np.ascontiguousarray(np.concatenate(dense, axis=1), dtype=np.float32)


def scale_out(w: Tensor, factor: float) -> Tensor:
    if isinstance(w, QuantMatrix):
        return w.scaled(factor)
    return (w * np.float32(factor)).astype(np.float32)
