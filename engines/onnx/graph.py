"""A tiny ONNX graph builder over onnx.helper, writing large initializers as external data.

Intermediate values get unique names; with a data file, every initializer of
at least :data:`EXTERNAL_MIN_BYTES` is written to it as it is added (4 KiB
aligned, so ONNX Runtime can map it), which keeps a model's build at about
one tensor of memory. :meth:`Graph.linear` is ``x @ w`` for a float matrix or
a :class:`~sessiontape.engines.weights.QuantMatrix` (MatMulNBits).
"""

from __future__ import annotations

from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt

from sessiontape.engines.weights import QuantMatrix, Tensor, concat_out

#: block sums of inputs up to this long are a MatMul against a block indicator, of longer
#: ones a ReduceSum (:meth:`Graph._block_sums`)
INDICATOR_MAX_K = 2048
#: initializers at least this large go to the external data file (when there is one)
EXTERNAL_MIN_BYTES = 1024
_ALIGN = 4096
MS = "com.microsoft"


class Graph:
    """A tiny builder over onnx.helper that names intermediate values uniquely.

    With ``data`` (an open binary file named ``data_name`` beside the model),
    large initializers are written to it as they are added (external data).
    """

    def __init__(self, data: BinaryIO | None = None, data_name: str = "") -> None:
        from onnx import helper

        self.h = helper
        self.nodes: list[Any] = []
        self.inits: list[Any] = []
        self.n = 0
        self._data = data
        self._data_name = data_name
        self._offset = 0

    def op(
        self,
        op_type: str,
        inputs: list[str],
        outputs: int = 1,
        name: str | None = None,
        **attrs: Any,
    ) -> Any:
        self.n += 1
        outs = (
            [name]
            if name and outputs == 1
            else [f"{op_type.lower()}_{self.n}_{i}" for i in range(outputs)]
        )
        self.nodes.append(
            self.h.make_node(op_type, inputs, outs, name=f"n{self.n}_{op_type}", **attrs)
        )
        return outs[0] if outputs == 1 else outs

    def const(self, name: str, value: npt.NDArray[Any]) -> str:
        from onnx import TensorProto, numpy_helper

        arr = np.asarray(value)
        if not arr.flags.c_contiguous:  # (ascontiguousarray would make a scalar 1-d)
            arr = arr.copy(order="C")
        if self._data is None or arr.nbytes < EXTERNAL_MIN_BYTES:
            self.inits.append(numpy_helper.from_array(arr, name))
            return name
        t = numpy_helper.from_array(arr[:0].reshape((0,) * max(arr.ndim, 1)), name)
        t.ClearField("dims")
        t.dims.extend(arr.shape)
        t.ClearField("raw_data")
        pad = -self._offset % _ALIGN
        self._data.write(b"\0" * pad)
        self._offset += pad
        self._data.write(arr.tobytes())
        t.data_location = TensorProto.EXTERNAL
        for key, val in (
            ("location", self._data_name),
            ("offset", str(self._offset)),
            ("length", str(arr.nbytes)),
        ):
            entry = t.external_data.add()
            entry.key, entry.value = key, val
        self._offset += arr.nbytes
        self.inits.append(t)
        return name

    def i64(self, name: str, *vals: int) -> str:
        return self.const(name, np.array(vals, dtype=np.int64))

    def linear_parts(
        self,
        x: str,
        name: str,
        parts: list[Tensor],
        accuracy_level: int,
        dtype: Any = np.float32,
    ) -> str:
        """``x`` times ``parts`` side by side along their outputs (q|k|v, gate|up): one
        matrix where the parts share a layout (:func:`concat_out`), else one per run of
        consecutive block matrices that do, their outputs concatenated, so each format
        keeps its own width (a Q4_K_M file's 4-bit q and k beside an 8-bit Q6_K v)."""
        runs: list[list[QuantMatrix]] = []
        for p in parts:
            if not isinstance(p, QuantMatrix) or np.dtype(dtype) != np.float32:
                runs = []
                break
            if runs and (runs[-1][0].bits, runs[-1][0].block, runs[-1][0].k) == (
                p.bits,
                p.block,
                p.k,
            ):
                runs[-1].append(p)
            else:
                runs.append([p])
        if len(runs) < 2:
            return self.linear(x, name, concat_out(parts), accuracy_level, dtype=dtype)
        outs = [
            self.linear(x, f"{name}.{j}", concat_out(list(run)), accuracy_level)
            for j, run in enumerate(runs)
        ]
        return str(self.op("Concat", outs, axis=-1))

    def linear(
        self,
        x: str,
        name: str,
        w: Tensor,
        accuracy_level: int,
        out: str | None = None,
        dtype: Any = np.float32,
    ) -> str:
        """``x @ w`` for ``x`` [b, s, in] and a float [in, out] matrix or a :class:`QuantMatrix`
        (named ``out``).

        With ``dtype`` float16 the matrix is stored as float16, a QuantMatrix dequantized
        first (its blocks run as MatMulNBits only in a float32 graph).
        """
        if isinstance(w, QuantMatrix) and np.dtype(dtype) != np.float32:
            w = np.ascontiguousarray(w.dequantize().T)
        if not isinstance(w, QuantMatrix):
            weight = self.const(name, w.astype(dtype, order="C", copy=False))
            return str(self.op("MatMul", [x, weight], name=out))
        inputs = [
            x,
            self.const(name + ".q", w.data),
            self.const(name + ".scales", w.scales.reshape(-1)),
        ]
        y = self.op(
            "MatMulNBits",
            inputs,
            domain=MS,
            K=w.k,
            N=w.n,
            bits=w.bits,
            block_size=w.block,
            accuracy_level=accuracy_level,
            name=out if w.offsets is None else None,
        )
        if w.offsets is None:
            return str(y)
        sums = self._block_sums(x, name, w.k, w.block)
        off = self.const(name + ".offsets", np.ascontiguousarray(w.offsets.T))
        return str(self.op("Add", [y, self.op("MatMul", [sums, off])], name=out))

    def _block_sums(self, x: str, name: str, k: int, block: int) -> str:
        """The sums of ``x`` [b, s, k] over each block of ``block`` inputs: [b, s, k / block].

        A MatMul against a 0/1 block indicator [k, k / block] reads k * k / block floats a
        token, more than a 4-bit matrix itself for large k: at k = 8192 it took 0.9 ms a
        call against 6 us for a ReduceSum over [b, s, k / block, block]. Up to
        :data:`INDICATOR_MAX_K` both take a few microseconds and the MatMul is kept, so
        that the models imported before (SmolLM2, k <= 1536) compute what they did."""
        if k <= INDICATOR_MAX_K:
            eye = np.eye(k // block, dtype=np.float32)
            indicator = np.kron(eye, np.ones((block, 1), np.float32))
            return str(self.op("MatMul", [x, self.const(name + ".blocks", indicator)]))
        shape = self.i64(name + ".block_shape", 0, 0, k // block, block)
        split = self.op("Reshape", [x, shape])
        axis = self.i64(name + ".last_axis", -1)
        return str(self.op("ReduceSum", [split, axis], keepdims=0))
