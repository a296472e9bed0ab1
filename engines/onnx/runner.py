"""One forward pass over ONNX Runtime, on the CPU or a CUDA device.

:class:`Runner` takes a cached KV snapshot, the number of its positions to
keep, and the next tokens, and returns their logits, the requested hidden
states and the new snapshot. It never mutates a snapshot (forks share them).

Bit-exactness: a pass always carries at least ``min_rows`` query rows (2 by
default). A single new token is padded with a dummy token one position
later; causal masking keeps it out of the real row, its logits are dropped,
and the next pass keeps only the real positions of the snapshot. ONNX
Runtime's CPU MatMul takes another path for exactly one row, which would
make a decoded position differ in its last bits from the same position
computed in a prefill chunk.

CPU: the snapshot tensors are numpy arrays; trimming the padding row is a
numpy slice. CUDA (``io_binding=True``): inputs and ``present`` outputs are
bound as device OrtValues, so the cache never leaves the GPU; only logits
and requested hidden states are copied to the host. Trimming runs a small
Slice graph on the device. The same binding path runs on the CPU when asked
(``io_binding=True`` with the CPU provider), which is how it is tested on a
machine without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.util import find_spec
from typing import Any

import numpy as np
import numpy.typing as npt

from sessiontape.core.errors import EngineError
from sessiontape.engines.onnx.kvcache import KV
from sessiontape.engines.onnx.model import GraphSpec

log = logging.getLogger("sessiontape.engines.onnx")

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"


def quiet_ort() -> Any:
    """Import onnxruntime with its logger set to errors only (no missing-CUDA warnings)."""
    import onnxruntime as ort

    ort.set_default_logger_severity(3)
    return ort


def run_host_bound(
    sess: Any,
    ids: Any,
    pos: Any,
    mask: Any,
    bind_kv: Callable[[Any], None],
    kv_outputs: int,
    hidden_layers: Sequence[int],
) -> tuple[Any, dict[int, Any]]:
    """One pass of ``sess`` on host inputs, its KV bound by ``bind_kv(binding)`` (which
    binds ``kv_outputs`` presents, the first outputs), returning the logits and the
    asked ``hidden_states.N`` in fresh host arrays: ``(logits, {N: hidden})``."""
    b = sess.io_binding()
    b.bind_cpu_input("input_ids", ids)
    b.bind_cpu_input("position_ids", pos)
    b.bind_cpu_input("attention_mask", mask)
    bind_kv(b)
    b.bind_output("logits", "cpu")
    for i in hidden_layers:
        b.bind_output(f"hidden_states.{i}", "cpu")
    sess.run_with_iobinding(b)
    # outputs come back in binding order: the presents first, then logits and hidden states
    rest = b.get_outputs()[kv_outputs:]
    return rest[0].numpy(), {i: rest[1 + j].numpy() for j, i in enumerate(hidden_layers)}


@functools.cache
def cuda_loads() -> bool:
    """Whether this build's CUDA provider loads here (libraries and a GPU), asked once, quietly.

    onnxruntime-gpu lists the provider on any machine; without the CUDA libraries every
    session that asks for it logs errors before falling back to the CPU.
    """
    ort = quiet_ort()
    if CUDA not in ort.get_available_providers():
        return False
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "probe",
        [x],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    so = ort.SessionOptions()
    so.log_severity_level = 4
    ort.set_default_logger_severity(4)
    try:
        sess = ort.InferenceSession(model.SerializeToString(), so, providers=[CUDA, CPU])
        return CUDA in sess.get_providers()
    except Exception:
        return False
    finally:
        ort.set_default_logger_severity(3)


def choose_providers(requested: str | Sequence[str]) -> list[str]:
    """ "auto" asks for CUDA only when this onnxruntime build offers it and it loads here;
    otherwise the CPU."""
    ort = quiet_ort()
    available = ort.get_available_providers()
    if isinstance(requested, str) and requested != "auto":
        requested = [p.strip() for p in requested.split(",") if p.strip()]
    if requested == "auto":
        return [CUDA, CPU] if cuda_loads() else [CPU]
    wanted = list(requested)
    missing = [p for p in wanted if p not in available]
    if missing:
        raise EngineError(
            f"execution providers {missing} are not available (available: {available})"
        )
    return wanted


def open_session(
    path: str,
    providers: Sequence[str],
    intra_op_threads: int,
    inter_op_threads: int,
    spinning: bool = True,
    cuda_graph: bool = False,
    fallback: bool = True,
) -> Any:
    """An InferenceSession; ``cuda_graph`` turns on ONNX Runtime's CUDA graph capture.

    With ``fallback``, a CUDA provider that fails to load gives a CPU session instead.
    """
    ort = quiet_ort()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = int(intra_op_threads)
    so.inter_op_num_threads = int(inter_op_threads)
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    if spinning:
        # spin between the operators of a pass, not after it: idle threads then leave
        # the CPU to the event loop and the log between passes (docs/engines.md, Threads)
        so.add_session_config_entry("session.force_spinning_stop", "1")
    cuda_opts = {"enable_cuda_graph": "1"} if cuda_graph else {}
    chosen: list[Any] = [(p, cuda_opts) if p == CUDA else p for p in providers]
    try:
        sess = ort.InferenceSession(path, so, providers=chosen)
    except Exception as exc:
        if fallback and CUDA in providers and providers != [CPU]:
            # the CUDA libraries can be missing even when the build offers the provider
            log.warning("CUDA provider failed to load (%s); using the CPU provider", exc)
            return ort.InferenceSession(path, so, providers=[CPU])
        raise EngineError(f"onnxruntime cannot load {path}: {exc}") from exc
    return sess


F32 = npt.NDArray[np.float32]


@dataclass
class PassResult:
    #: [rows, vocab] for the real rows
    logits: F32
    #: hidden_states.N -> [rows, hidden] for the requested layers
    hidden: dict[int, F32]
    kv: KV
    #: one past the last position the pass wrote (real, guessed and padding rows)
    end: int
    #: the pass row of ``logits[0]``: the head ran on the rows from this one on
    logits_from: int = 0

    def row_logits(self, row: int) -> F32:
        """The logits of the pass's row ``row`` (one the head ran on)."""
        if row < self.logits_from:
            raise EngineError(f"the pass computed logits from row {self.logits_from}, not {row}")
        out: F32 = self.logits[row - self.logits_from]
        return out


class Runner:
    """Passes over a ``concat``-layout model: immutable snapshots, ``present`` = past + new."""

    static = False

    def __init__(
        self, sess: Any, spec: GraphSpec, *, io_binding: bool, min_rows: int = 2, pad_token: int = 0
    ) -> None:
        self.sess = sess
        self.spec = spec
        self.provider = str(sess.get_providers()[0])
        self.device = "cuda" if self.provider == CUDA else "cpu"
        self.io_binding = io_binding
        self.min_rows = max(1, int(min_rows))
        self.pad_token = int(pad_token)
        self.names = [
            f"past_key_values.{i}.{k}" for i in range(spec.layers) for k in ("key", "value")
        ]
        self.present = [f"present.{i}.{k}" for i in range(spec.layers) for k in ("key", "value")]
        self._trim: Any = None
        self.itemsize = int(np.dtype(spec.kv_dtype).itemsize)

    def empty(self) -> KV:
        shape = (1, self.spec.kv_heads, 0, self.spec.head_dim)
        if self.io_binding:
            ort = quiet_ort()
            t = tuple(
                ort.OrtValue.ortvalue_from_shape_and_type(shape, self.spec.kv_dtype, self.device, 0)
                for _ in self.names
            )
        else:
            t = tuple(np.zeros(shape, self.spec.kv_dtype) for _ in self.names)
        return KV(t, 0, 0)

    def _nbytes(self, length: int) -> int:
        return len(self.names) * self.spec.kv_heads * length * self.spec.head_dim * self.itemsize

    def trim(self, kv: KV, keep: int) -> KV:
        """The first ``keep`` positions of ``kv`` as a snapshot of exactly that length (a copy)."""
        if kv.length == keep:
            return kv
        if self.io_binding:
            t = tuple(self._trimmed(kv, keep))
        else:
            t = tuple(np.ascontiguousarray(x[:, :, :keep]) for x in kv.tensors)
        return KV(t, keep, self._nbytes(keep))

    def run(
        self,
        kv: KV,
        keep: int,
        tokens: Sequence[int],
        hidden_layers: Sequence[int],
        logits_from: int = 0,
    ) -> PassResult:
        """Run ``tokens`` at positions ``keep..`` on the first ``keep`` positions of ``kv``
        (every row's logits: ``logits_from`` is a hint this runner does not take)."""
        n = len(tokens)
        ids = list(tokens) + [self.pad_token] * max(0, self.min_rows - n)
        rows = len(ids)
        feeds_small: dict[str, Any] = {
            "input_ids": np.asarray([ids], dtype=np.int64),
            "attention_mask": np.ones((1, keep + rows), dtype=np.int64),
            "position_ids": np.arange(keep, keep + rows, dtype=np.int64)[None, :],
        }
        hidden_names = [f"hidden_states.{i}" for i in hidden_layers]
        try:
            if self.io_binding:
                logits, hidden, present = self._run_bound(kv, keep, feeds_small, hidden_names)
            else:
                past = [
                    t if kv.length == keep else np.ascontiguousarray(t[:, :, :keep])
                    for t in kv.tensors
                ]
                feeds: dict[str, Any] = dict(feeds_small)
                feeds.update(zip(self.names, past, strict=True))
                out = self.sess.run(["logits", *hidden_names, *self.present], feeds)
                logits = out[0]
                hidden = out[1 : 1 + len(hidden_names)]
                present = tuple(out[1 + len(hidden_names) :])
        except EngineError:
            raise
        except Exception as exc:
            raise EngineError(f"onnxruntime run failed: {exc}") from exc
        return PassResult(
            logits=np.asarray(logits[0, :n]),
            hidden={i: np.asarray(h[0, :n]) for i, h in zip(hidden_layers, hidden, strict=True)},
            kv=KV(tuple(present), keep + rows, self._nbytes(keep + rows)),
            end=keep + rows,
        )

    def release(self, kv: KV) -> None:
        """Snapshots are freed with their last reference."""

    def copy(self, kv: KV) -> KV:
        """Snapshots are never written to, so sharing one needs no copy."""
        return kv

    def _run_bound(
        self, kv: KV, keep: int, small: dict[str, Any], hidden_names: list[str]
    ) -> tuple[Any, list[Any], tuple[Any, ...]]:
        past = kv.tensors if kv.length == keep else self._trimmed(kv, keep)
        b = self.sess.io_binding()
        for name, value in small.items():
            b.bind_cpu_input(name, value)
        for name, value in zip(self.names, past, strict=True):
            b.bind_ortvalue_input(name, value)
        b.bind_output("logits", "cpu")
        for name in hidden_names:
            b.bind_output(name, "cpu")
        for name in self.present:
            b.bind_output(name, self.device, 0)
        self.sess.run_with_iobinding(b)
        out = b.get_outputs()
        logits = out[0].numpy()
        hidden = [o.numpy() for o in out[1 : 1 + len(hidden_names)]]
        return logits, hidden, tuple(out[1 + len(hidden_names) :])

    def _trimmed(self, kv: KV, keep: int) -> list[Any]:
        """The first ``keep`` positions of every tensor, computed where the tensors live."""
        ort = quiet_ort()
        if self._trim is None:
            self._trim = ort.InferenceSession(
                _trim_model(len(self.names), self.spec.kv_dtype),
                _session_options(ort),
                providers=[self.provider],
            )
        b = self._trim.io_binding()
        for i, t in enumerate(kv.tensors):
            b.bind_ortvalue_input(f"x{i}", t)
            b.bind_output(f"y{i}", self.device, 0)
        b.bind_cpu_input("end", np.asarray([keep], dtype=np.int64))
        self._trim.run_with_iobinding(b)
        return list(b.get_outputs())


def _session_options(ort: Any) -> Any:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return so


def _trim_model(count: int, dtype: Any) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    elem = TensorProto.FLOAT16 if np.dtype(dtype) == np.float16 else TensorProto.FLOAT
    shape = ["b", "h", "t", "d"]
    nodes = [
        helper.make_node("Slice", [f"x{i}", "start", "end", "axis"], [f"y{i}"])
        for i in range(count)
    ]
    inputs = [helper.make_tensor_value_info(f"x{i}", elem, shape) for i in range(count)]
    inputs.append(helper.make_tensor_value_info("end", TensorProto.INT64, [1]))
    outputs = [
        helper.make_tensor_value_info(f"y{i}", elem, ["b", "h", "k", "d"]) for i in range(count)
    ]
    inits = [
        numpy_helper.from_array(np.asarray([0], np.int64), "start"),
        numpy_helper.from_array(np.asarray([2], np.int64), "axis"),
    ]
    graph = helper.make_graph(nodes, "trim", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


def preload_cuda(ort: Any, providers: str | Sequence[str]) -> None:
    """Load the CUDA libraries of the `cuda` extra (nvidia-* wheels) when they are installed."""
    preload = getattr(ort, "preload_dlls", None)
    if preload is None or providers == "CPUExecutionProvider" or find_spec("nvidia") is None:
        return
    out = io.StringIO()  # it prints what it misses
    try:
        with contextlib.redirect_stdout(out):
            preload()
    except Exception as exc:  # pragma: no cover - depends on the machine's CUDA install
        log.debug("onnxruntime.preload_dlls failed: %s", exc)
    if out.getvalue().strip():
        log.debug("onnxruntime.preload_dlls: %s", out.getvalue().strip())
