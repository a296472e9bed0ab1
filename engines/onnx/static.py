"""Forward passes over a static KV buffer updated in place (the ``static`` model layout).

A static-layout model (see :mod:`sessiontape.engines.onnx.demo`) takes one buffer per
layer and kind, ``[1, kv_heads, capacity, head_dim]``, writes the pass's new
keys and values into it at ``position_ids`` and masks slot j for the query
at position q unless j <= q. :class:`StaticRunner` binds ``present`` to the
same OrtValue as ``past``, so the buffer never moves and is never copied.

Two shapes of use, chosen per provider by the engine:

- **Fixed** (``rows`` and ``capacity`` set; the CUDA default): every pass,
  prefill chunk or decode step, has exactly ``rows`` query rows over a
  buffer of exactly ``capacity`` slots. On a GPU the kernels (cuBLAS GEMMs,
  softmax) are chosen by operand shapes, so one shape means one summation
  order for every position however its history was built up. Rows the pass
  does not need are padding; their writes land past the valid positions
  (clamped to the last slot, which no valid position reaches) and their
  logits are dropped. The buffer is zeroed when allocated, so a masked slot
  can never turn a sum into NaN; stale values in masked slots are finite and
  contribute an exact zero. Every input and output is a preallocated device
  OrtValue, so with ``cuda_graph`` the pass is captured once per buffer set
  (ONNX Runtime's ``gpu_graph_id``) and replayed; only logits (and hidden
  states when a readout asks) are copied to the host.
- **Growing** (``capacity=None``; the CPU default): the buffer grows in
  ``bucket``-slot steps (a copy only when it grows) and a pass carries
  ``min_rows``..``prefill_chunk`` rows. ONNX Runtime's CPU kernels keep a
  row's bits across row counts of 2 or more and across masked tails, which
  the engine's bit-exactness tests check.

Buffers are owned by the engine's KV cache. A fork shares its parent's
buffer; the engine copies a shared buffer before a pass writes into it.
Fixed buffers are recycled through a free list, so their device addresses
(and the CUDA graphs captured on them) stay valid.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sessiontape.core.errors import EngineError
from sessiontape.engines.onnx.decoder import LOGITS_FROM
from sessiontape.engines.onnx.kvcache import KV
from sessiontape.engines.onnx.model import GraphSpec
from sessiontape.engines.onnx.runner import CUDA, PassResult, quiet_ort, run_host_bound

log = logging.getLogger("sessiontape.engines.onnx")


class StaticRunner:
    """One forward pass at a time over static, in-place KV buffers."""

    static = True

    def __init__(
        self,
        sess: Any,
        spec: GraphSpec,
        *,
        rows: int | None,
        capacity: int | None,
        min_rows: int = 2,
        pad_token: int = 0,
        bucket: int = 256,
        cuda_graph: bool = False,
    ) -> None:
        self.sess = sess
        self.spec = spec
        self.provider = str(sess.get_providers()[0])
        self.device = "cuda" if self.provider == CUDA else "cpu"
        self.io_binding = True
        self.rows = None if rows is None else int(rows)
        self.capacity = None if capacity is None else int(capacity)
        if (self.rows is None) != (self.capacity is None):
            raise EngineError("fixed passes need both a row count and a buffer capacity")
        self.min_rows = self.rows or max(1, int(min_rows))
        self.pad_token = int(pad_token)
        self.bucket = int(bucket)
        self.cuda_graph = bool(cuda_graph) and self.fixed and self.device == "cuda"
        self.names = [
            f"past_key_values.{i}.{k}" for i in range(spec.layers) for k in ("key", "value")
        ]
        self.present = [f"present.{i}.{k}" for i in range(spec.layers) for k in ("key", "value")]
        self.hidden_names = [f"hidden_states.{i}" for i in spec.hidden_layers]
        #: the graph takes ``logits_from`` (an imported model's does): a growing pass may
        #: ask for the logits of its last rows only
        self.logits_from = any(
            i.name == LOGITS_FROM for i in getattr(sess, "get_overridable_initializers", list)()
        )
        self.dtype = np.dtype(spec.kv_dtype)
        self._free: list[tuple[Any, ...]] = []
        self._sets: list[tuple[Any, ...]] = []
        self._ids: dict[int, int] = {}  # id(first tensor of a set) -> graph id
        self._copy: Any = None
        self._lock = threading.Lock()
        self._io: dict[str, Any] | None = None
        #: the last growing pass's binding (its buffer set and shape)
        self._grown_binding: _GrownBinding | None = None
        self._bound: dict[int, tuple[Any, Any, tuple[Any, ...]]] = {}
        if self.fixed:
            self._io = self._fixed_io()

    @property
    def fixed(self) -> bool:
        return self.capacity is not None

    def _shape(self, capacity: int) -> tuple[int, int, int, int]:
        return (1, self.spec.kv_heads, capacity, self.spec.head_dim)

    def nbytes(self, capacity: int) -> int:
        return (
            len(self.names)
            * self.spec.kv_heads
            * capacity
            * self.spec.head_dim
            * int(self.dtype.itemsize)
        )

    # -- buffers -----------------------------------------------------------

    def _zeros(self, capacity: int) -> tuple[Any, ...]:
        ort = quiet_ort()
        zero = np.zeros(self._shape(capacity), self.dtype)
        if self.device == "cpu":
            return tuple(ort.OrtValue.ortvalue_from_numpy(zero.copy()) for _ in self.names)
        out = []
        for _ in self.names:
            v = ort.OrtValue.ortvalue_from_shape_and_type(zero.shape, self.dtype, self.device, 0)
            v.update_inplace(zero)
            out.append(v)
        return tuple(out)

    def empty(self) -> KV:
        """A zeroed buffer set (recycled from the free list when fixed)."""
        if self.fixed:
            assert self.capacity is not None
            if self._free:
                return KV(self._free.pop(), self.capacity, self.nbytes(self.capacity))
            kv = KV(self._zeros(self.capacity), self.capacity, self.nbytes(self.capacity))
            # held for good: a graph id is keyed by the tensors' id(), which a freed set would hand on
            self._sets.append(kv.tensors)
            self._ids[id(kv.tensors[0])] = len(self._ids)
            if self.cuda_graph:
                self._capture(kv)
            return kv
        return KV(self._zeros(self.bucket), self.bucket, self.nbytes(self.bucket))

    def release(self, kv: KV) -> None:
        """The cache no longer holds ``kv``: keep a fixed buffer set for reuse."""
        if (
            self.fixed
            and kv.tensors
            and id(kv.tensors[0]) in self._ids
            and not any(t is kv.tensors for t in self._free)
        ):
            self._free.append(kv.tensors)

    def copy(self, kv: KV) -> KV:
        """A private buffer set holding what ``kv`` holds (before writing into a shared one)."""
        if not self.fixed:
            ort = quiet_ort()
            t = tuple(
                ort.OrtValue.ortvalue_from_numpy(np.array(x.numpy(), copy=True)) for x in kv.tensors
            )
            return KV(t, kv.length, kv.nbytes)
        dst = self.empty()
        self._device_copy(kv.tensors, dst.tensors)
        return dst

    def _device_copy(self, src: Sequence[Any], dst: Sequence[Any]) -> None:
        ort = quiet_ort()
        if self._copy is None:
            so = ort.SessionOptions()
            so.log_severity_level = 3
            self._copy = ort.InferenceSession(
                _copy_model(len(self.names), self.dtype), so, providers=[self.provider]
            )
        b = self._copy.io_binding()
        for i, (s, d) in enumerate(zip(src, dst, strict=True)):
            b.bind_ortvalue_input(f"x{i}", s)
            b.bind_ortvalue_output(f"y{i}", d)
        self._copy.run_with_iobinding(b)

    def _grown(self, kv: KV, need: int) -> KV:
        """``kv`` with room for ``need`` slots (a bigger copy when it has less)."""
        if kv.length >= need:
            return kv
        ort = quiet_ort()
        cap = -(-need // self.bucket) * self.bucket
        out = []
        for x in kv.tensors:
            big = np.zeros(self._shape(cap), self.dtype)
            big[:, :, : kv.length] = x.numpy()
            out.append(ort.OrtValue.ortvalue_from_numpy(big))
        return KV(tuple(out), cap, self.nbytes(cap))

    def trim(self, kv: KV, keep: int) -> KV:
        """Nothing to trim: slots past the valid positions are masked and rewritten."""
        return kv

    # -- passes ------------------------------------------------------------

    def _fixed_io(self) -> dict[str, Any]:
        ort = quiet_ort()
        assert self.rows is not None and self.capacity is not None
        rows, dev = self.rows, self.device
        vocab = self.spec.vocab_size
        if vocab is None:
            raise EngineError(
                "fixed passes need a model whose logits have a fixed vocabulary dimension"
            )

        def value(shape: tuple[int, ...], dtype: Any, fill: Any = None) -> Any:
            v = ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, dev, 0)
            if fill is not None:
                v.update_inplace(np.full(shape, fill, dtype))
            return v

        io = {
            "input_ids": value((1, rows), np.int64, 0),
            "position_ids": value((1, rows), np.int64, 0),
            "attention_mask": value((1, self.capacity), np.int64, 1),
            "logits": value((1, rows, vocab), np.float32),
        }
        if self.spec.hidden_size is not None:
            for name in self.hidden_names:
                io[name] = value((1, rows, self.spec.hidden_size), np.float32)
        return io

    def run(
        self,
        kv: KV,
        keep: int,
        tokens: Sequence[int],
        hidden_layers: Sequence[int],
        logits_from: int = 0,
    ) -> PassResult:
        """Run ``tokens`` at positions ``keep..`` on ``kv`` (written in place); pads fill the rest.

        ``logits_from``: the first row whose logits the caller needs. On growing buffers, with
        a graph that takes it, the output head runs on the rows from there on (at least
        ``min_rows`` of them, so a row's bits are those of any other pass); else on all."""
        n = len(tokens)
        rows = self.rows or max(n, self.min_rows)
        if n > rows:
            raise EngineError(f"a pass holds at most {rows} tokens, not {n}")
        first = 0
        if self.logits_from and not self.fixed and self.spec.vocab_size is not None:
            first = max(0, min(int(logits_from), n - 1, rows - self.min_rows))
        if not self.fixed:
            kv = self._grown(kv, keep + rows)
        cap = kv.length
        ids = np.full((1, rows), self.pad_token, np.int64)
        ids[0, :n] = tokens
        pos = np.minimum(np.arange(keep, keep + rows, dtype=np.int64), cap - 1)[None, :]
        try:
            with self._lock:
                if self.fixed:
                    logits, hidden = self._run_fixed(kv, ids, pos, hidden_layers)
                else:
                    logits, hidden = self._run_grown(kv, ids, pos, hidden_layers, first)
        except EngineError:
            raise
        except Exception as exc:
            raise EngineError(f"onnxruntime run failed: {exc}") from exc
        # copies: on the CPU an OrtValue's numpy() is a view of the bound output, which the next
        # pass (of any session) overwrites
        return PassResult(
            logits=np.array(logits[: n - first]),
            hidden={i: np.array(h[:n]) for i, h in hidden.items()},
            kv=kv,
            end=keep + rows,
            logits_from=first,
        )

    def _bind_kv(self, b: Any, kv: KV) -> None:
        for past, present, t in zip(self.names, self.present, kv.tensors, strict=True):
            b.bind_ortvalue_input(past, t)
            b.bind_ortvalue_output(present, t)

    def _run_grown(
        self, kv: KV, ids: Any, pos: Any, hidden_layers: Sequence[int], first: int = 0
    ) -> tuple[Any, dict[int, Any]]:
        """One pass over a growing buffer set, through a binding kept for the last buffer set
        and pass shape (a session decoding binds its layers once, not every pass, and reads
        its logits from a bound array instead of fetching every output)."""
        if self.spec.vocab_size is None:  # symbolic logits: ONNX Runtime allocates them
            logits, hidden = run_host_bound(
                self.sess,
                ids,
                pos,
                np.ones((1, kv.length), np.int64),
                lambda b: self._bind_kv(b, kv),
                len(self.present),
                hidden_layers,
            )
            return logits[0], {i: h[0] for i, h in hidden.items()}
        key = (id(kv.tensors), ids.shape[1], tuple(hidden_layers), first)
        bound = self._grown_binding
        if bound is None or bound.key != key or bound.tensors is not kv.tensors:
            bound = self._grown_binding = self._bind_grown(kv, ids.shape[1], hidden_layers, key)
        bound.ids[...] = ids
        bound.pos[...] = pos
        self.sess.run_with_iobinding(bound.binding)
        # copies: the caller keeps rows of a pass (the last logits, a guess) across passes
        return bound.logits[0].copy(), {i: h[0].copy() for i, h in bound.hidden.items()}

    def _bind_grown(
        self,
        kv: KV,
        rows: int,
        hidden_layers: Sequence[int],
        key: tuple[int, int, tuple[int, ...], int],
    ) -> _GrownBinding:
        ort = quiet_ort()
        b = self.sess.io_binding()
        ids = np.zeros((1, rows), np.int64)
        pos = np.zeros((1, rows), np.int64)
        mask = np.ones((1, kv.length), np.int64)
        first = key[3]
        feeds = [("input_ids", ids), ("position_ids", pos), ("attention_mask", mask)]
        if self.logits_from:
            feeds.append((LOGITS_FROM, np.array([first], np.int64)))
        for name, arr in feeds:
            b.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(arr))
        self._bind_kv(b, kv)
        assert self.spec.vocab_size is not None
        logits = np.empty((1, rows - first, self.spec.vocab_size), np.float32)
        b.bind_ortvalue_output("logits", ort.OrtValue.ortvalue_from_numpy(logits))
        hidden: dict[int, Any] = {}
        for i in hidden_layers:
            assert self.spec.hidden_size is not None
            hidden[i] = np.empty((1, rows, self.spec.hidden_size), np.float32)
            b.bind_ortvalue_output(
                f"hidden_states.{i}", ort.OrtValue.ortvalue_from_numpy(hidden[i])
            )
        return _GrownBinding(key, kv.tensors, b, ids, pos, mask, logits, hidden)

    def _run_fixed(
        self, kv: KV, ids: Any, pos: Any, hidden_layers: Sequence[int]
    ) -> tuple[Any, dict[int, Any]]:
        io = self._io
        assert io is not None
        io["input_ids"].update_inplace(ids)
        io["position_ids"].update_inplace(pos)
        b, ro = self._binding(kv)
        self.sess.run_with_iobinding(b, ro)
        return io["logits"].numpy()[0], {
            i: io[f"hidden_states.{i}"].numpy()[0] for i in hidden_layers
        }

    def _capture(self, kv: KV) -> None:
        """Run a new buffer set's graph until it is captured, before any real pass.

        ONNX Runtime runs a graph id normally before capturing it, and cuBLAS
        may pick another algorithm (another summation order) outside a
        capture than inside one; so every real pass must be a replay. These
        passes write only the last slot, which no valid position reaches.
        """
        assert self.rows is not None and self.capacity is not None
        ids = np.full((1, self.rows), self.pad_token, np.int64)
        pos = np.full((1, self.rows), self.capacity - 1, np.int64)
        with self._lock:
            for _ in range(3):
                self._run_fixed(kv, ids, pos, ())

    def _binding(self, kv: KV) -> tuple[Any, Any]:
        """One IOBinding and RunOptions per buffer set, bound once: every address stays fixed."""
        key = self._ids.setdefault(id(kv.tensors[0]), len(self._ids))
        got = self._bound.get(key)
        if got is not None and got[2] is kv.tensors:
            return got[0], got[1]
        ort = quiet_ort()
        io = self._io
        assert io is not None
        b = self.sess.io_binding()
        for name in ("input_ids", "position_ids", "attention_mask"):
            b.bind_ortvalue_input(name, io[name])
        self._bind_kv(b, kv)
        b.bind_ortvalue_output("logits", io["logits"])
        for name in self.hidden_names:
            if name in io:
                b.bind_ortvalue_output(name, io[name])
        ro = ort.RunOptions()
        if self.cuda_graph:
            ro.add_run_config_entry("gpu_graph_id", str(1 + key))
        self._bound[key] = (b, ro, kv.tensors)
        return b, ro


def _copy_model(count: int, dtype: Any) -> bytes:
    from onnx import TensorProto, helper

    elem = TensorProto.FLOAT16 if np.dtype(dtype) == np.float16 else TensorProto.FLOAT
    shape = ["b", "h", "t", "d"]
    nodes = [helper.make_node("Identity", [f"x{i}"], [f"y{i}"]) for i in range(count)]
    inputs = [helper.make_tensor_value_info(f"x{i}", elem, shape) for i in range(count)]
    outputs = [helper.make_tensor_value_info(f"y{i}", elem, shape) for i in range(count)]
    model = helper.make_model(
        helper.make_graph(nodes, "copy", inputs, outputs),
        opset_imports=[helper.make_opsetid("", 18)],
    )
    model.ir_version = 8
    return bytes(model.SerializeToString())


@dataclass(eq=False)
class _GrownBinding:
    """A growing pass's I/O binding: its buffer set, host inputs and bound outputs."""

    key: tuple[int, int, tuple[int, ...], int]
    tensors: Any
    binding: Any
    ids: Any
    pos: Any
    mask: Any
    logits: Any
    hidden: dict[int, Any]
