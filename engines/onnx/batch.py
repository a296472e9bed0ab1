"""Continuous batching: the decode steps of every generating session in one forward pass.

A decode step reads all of the model's weights to produce one token; eight
sessions decoding one pass each read them eight times. The scheduler here
runs one thread that owns the ONNX Runtime session's passes. Every turn it

1. runs at most ``prefill_share`` queued prefill chunks (each a pass over one
   session's own buffer; the fairness bound that keeps a long prompt from
   stalling everyone's decode),
2. admits waiting sessions into free KV slots and retires finished, stopped
   or failed ones (sessions join and leave between passes),
3. samples the next token of every admitted session from its last logits
   (per-session seeds, temperature, top-k/top-p, stop ids, logprobs, readouts)
   and runs one pass with a row per slot (a lone slot: ``[token, lookahead
   guess or pad]``), then hands each session its rows.

**KV slots.** One pool per layer and kind, ``[slots, kv_heads, capacity,
head_dim]``. A session's prefill runs on its own buffer (the engine's KV
cache entry); on admission its positions are copied into a free slot, and on
leaving the slot's positions are copied into a new buffer that the cache
entry then holds. Slots are held only by generating sessions, so a full pool
makes new sessions wait (``wait_s``, then :class:`sessiontape.core.errors.EngineBusy`)
and never evicts a generating one. The capacity grows in ``bucket`` steps
with the longest admitted history and shrinks when it halves, so short
sessions do not attend over empty slots.

**Bit-exactness.** A pass over ``k`` slots is ONNX Runtime's GEMMs over
``k`` (or 2) rows and per-slot attention over the query rows of each KV group; on the CPU provider a row's bits do not
depend on the row count (two or more), on the masked tail of its buffer or
on what the other rows hold (tests/engines/onnx/test_batch_invariance.py), so a
session's tokens and logprobs are the same alone, beside any neighbours,
and as in the engine's single-session path. A slot that is not generating
this pass is padding: its rows write only the pool's last slot, which no
valid position reaches.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sessiontape.core.engine.interface import OutputOptions, SamplingParams, Step
from sessiontape.core.errors import EngineBusy, EngineError
from sessiontape.engines.onnx.decoder import KV_SLOTS
from sessiontape.engines.onnx.kvcache import KV
from sessiontape.engines.onnx.model import GraphSpec
from sessiontape.engines.onnx.run import Guess, Run
from sessiontape.engines.onnx.runner import PassResult, quiet_ort, run_host_bound
from sessiontape.engines.onnx.static import attended_slots

log = logging.getLogger("sessiontape.engines.onnx")

#: rows per slot in a decode pass: the token and one lookahead guess (or padding); two rows
#: also keep ONNX Runtime's CPU MatMul off its one-row path, which sums in another order
ROWS = 2


@dataclass(eq=False)
class Stats:
    """What one session's share of the scheduler's work added to the engine's counters."""

    passes: int = 0
    positions: int = 0
    hits: int = 0


@dataclass(eq=False)
class Member:
    """One generating session in the batch (created on the loop thread, driven by the scheduler)."""

    run: Run
    params: SamplingParams
    options: OutputOptions
    #: hands a list of Steps and Stats to the session's generator (thread-safe)
    post: Callable[[list[object]], None]
    #: called once on the loop thread when the session has left: (tokens, kv or None, error)
    left: Callable[[list[int], KV | None, BaseException | None], None]
    #: per-layer hidden states of one row -> readout scores (when the session asks for readouts)
    readout: Callable[[dict[int, Any]], tuple[float, ...]] | None = None
    lookahead: bool = True
    #: steps handed out / taken by the generator: at most ``credit`` outstanding
    sent: int = 0
    taken: int = 0
    slot: int | None = None
    stop: bool = False
    state: str = "waiting"  # waiting -> active -> gone
    admitted: threading.Event = field(default_factory=threading.Event)
    #: this pass's request: the real token's position, and the guess run after it
    row_pos: int = -1
    row_guess: int | None = None
    row_want: bool = False
    row_more: bool = True
    row_step: Step | None = None
    #: set (under the scheduler's lock) before ``left`` is called
    left_called: bool = False
    #: the generator's side: where ``post`` delivers, and set once ``left`` has run on the loop
    inbox: asyncio.Queue[list[object]] | None = None
    gone: asyncio.Event | None = None
    #: what ``left`` handed back: the tokens the slot ran and their KV (None after a failure)
    result: tuple[list[int], KV | None] | None = None
    stats: Stats = field(default_factory=Stats)


@dataclass(eq=False)
class _Task:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]


class BatchScheduler:
    """One thread running every pass of one ONNX Runtime session: decode batched across sessions."""

    def __init__(
        self,
        sess: Any,
        spec: GraphSpec,
        *,
        slots: int,
        max_capacity: int,
        pad_token: int,
        bucket: int = 256,
        credit: int = 32,
        prefill_share: int = 1,
        wait_s: float = 30.0,
        readout_layers: Sequence[int] = (),
        single_row: bool = False,
    ) -> None:
        self.sess = sess
        self.spec = spec
        self.slots = int(slots)
        self.max_capacity = int(max_capacity)
        self.pad = int(pad_token)
        self.bucket = int(bucket)
        self.credit = int(credit)
        self.prefill_share = int(prefill_share)
        self.wait_s = float(wait_s)
        self.readout_layers = tuple(readout_layers)
        #: one row per slot when a pass spans two or more slots (see _decode)
        self.single_row = bool(single_row)
        self.names = [
            f"past_key_values.{i}.{k}" for i in range(spec.layers) for k in ("key", "value")
        ]
        self.present = [n.replace("past_key_values", "present") for n in self.names]
        #: the graph takes ``kv_slots`` (a pass attends over the slots its sessions fill)
        self.kv_slots = KV_SLOTS in {i.name for i in sess.get_overridable_initializers()}
        self.dtype = np.dtype(spec.kv_dtype)
        self.capacity = 0
        self.pool: list[np.ndarray] = []
        #: decode passes' I/O bindings by (slots, rows), made for the pool in place
        self._bound: dict[tuple[int, int], _Bound] = {}
        self._free = list(range(self.slots))
        self._slot_of: dict[int, Member] = {}
        self._waiting: deque[Member] = deque()
        self._tasks: deque[_Task] = deque()
        self._cond = threading.Condition()
        self._closed = False
        #: gauges for /metrics: real rows over all rows of the last pass
        self.occupancy = 0.0
        self.passes = 0
        #: passes that carried more than one session
        self.shared_passes = 0
        self._thread = threading.Thread(target=self._main, name="onnx-batch", daemon=True)
        self._thread.start()

    # -- the loop thread's side ---------------------------------------------

    def stats(self) -> dict[str, float]:
        return {
            "slots": float(self.slots),
            "slots_in_use": float(self.slots - len(self._free)),
            "queue": float(len(self._waiting)),
            "pass_occupancy": self.occupancy,
            "passes": float(self.passes),
            "shared_passes": float(self.shared_passes),
            "pool_bytes": float(self.pool_bytes()),
        }

    def pool_bytes(self) -> int:
        return sum(int(t.nbytes) for t in self.pool)

    def submit(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        """Run ``fn(*args)`` on the scheduler's thread between decode passes (a prefill chunk)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        with self._cond:
            if self._closed:
                raise EngineError("the engine is closed")
            self._tasks.append(_Task(fn, args, loop, fut))
            self._cond.notify()
        return fut

    def join(self, m: Member) -> None:
        with self._cond:
            if self._closed:
                raise EngineError("the engine is closed")
            self._waiting.append(m)
            self._cond.notify()

    async def admitted(self, m: Member) -> None:
        """Wait until ``m`` holds a slot; :class:`EngineBusy` after ``wait_s``."""
        if m.admitted.is_set():
            return
        deadline = time.monotonic() + self.wait_s
        while not m.admitted.is_set():
            if m.state == "gone":
                return  # failed before admission: its generator hears why
            left = deadline - time.monotonic()
            if left <= 0:
                with self._cond:
                    if m.state == "waiting":
                        self._waiting.remove(m)
                        m.state = "gone"
                        raise EngineBusy(
                            f"all {self.slots} KV slots are held by generating sessions "
                            f"(waited {self.wait_s:g} s)"
                        )
                continue
            await asyncio.sleep(min(0.002, left))

    def leave(self, m: Member) -> bool:
        """The generator is done with ``m``: drop it. True if the scheduler will call ``m.left``."""
        with self._cond:
            m.stop = True
            if m.state == "waiting":
                self._waiting.remove(m)
                m.state = "gone"
                return False
            self._cond.notify()
            return m.state == "active" or m.left_called

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def close(self) -> None:
        self.shutdown()
        self._thread.join(timeout=30)

    def shutdown(self) -> None:
        """Tell the thread to end (members leave with an error) without waiting for it."""
        with self._cond:
            self._closed = True
            self._cond.notify()

    # -- the scheduler thread ------------------------------------------------

    def _main(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._work_locked():
                    self._cond.wait()
                if self._closed:
                    break
                tasks = [
                    self._tasks.popleft()
                    for _ in range(
                        len(self._tasks)
                        if not self._slot_of
                        else min(self.prefill_share, len(self._tasks))
                    )
                ]
            for t in tasks:
                self._run_task(t)
            try:
                self._admit_and_retire()
                self._decode()
            except BaseException as exc:  # a bug here must not hang every generation
                log.exception("batch scheduler turn failed; its sessions end with an error")
                err = EngineError(f"the batch scheduler failed: {exc!r}")
                for m in list(self._slot_of.values()):
                    if m.state == "active" and not m.left_called:
                        self._retire(m, err)
        # closing: every member leaves, every queued task fails
        for m in list(self._slot_of.values()):
            self._retire(m, EngineError("the engine is closed"))
        for t in self._tasks:
            t.loop.call_soon_threadsafe(_fail, t.future, EngineError("the engine is closed"))

    def _work_locked(self) -> bool:
        if self._tasks:
            return True
        if self._waiting and (self._free or any(w.stop for w in self._waiting)):
            return True
        return any(
            m.stop or m.run.done or m.sent - m.taken < self.credit for m in self._slot_of.values()
        )

    def _run_task(self, t: _Task) -> None:
        try:
            result = t.fn(*t.args)
        except BaseException as exc:  # handed to the awaiting coroutine
            t.loop.call_soon_threadsafe(_fail, t.future, exc)
        else:
            t.loop.call_soon_threadsafe(_succeed, t.future, result)

    def _admit_and_retire(self) -> None:
        for m in [m for m in self._slot_of.values() if m.stop or m.run.done]:
            self._retire(m, None)
        while True:
            with self._cond:
                if not self._waiting or not self._free:
                    return
                m = self._waiting.popleft()
                if m.stop:
                    m.state = "gone"
                    continue
                slot = self._free.pop(0)
                m.slot, m.state = slot, "active"
                self._slot_of[slot] = m
            try:
                self._fit(len(m.run.hist))
                r = m.run
                for dst, src in zip(self.pool, r.base.tensors, strict=True):
                    dst[slot, :, : r.base_len] = src.numpy()[0, :, : r.base_len]
                if m.lookahead and r.follow is None:
                    r.index()
            except BaseException as exc:
                self._retire(m, exc if isinstance(exc, EngineError) else EngineError(str(exc)))
                continue
            m.admitted.set()

    def _fit(self, longest: int) -> None:
        """Capacity for ``longest`` positions plus a row pair and the padding slot."""
        need = min(self.max_capacity, -(-(longest + ROWS + 1) // self.bucket) * self.bucket)
        if need <= self.capacity and (need * 2 > self.capacity or not self._slot_of):
            return
        if need <= self.capacity and self._slot_of:
            longest_held = max(len(m.run.hist) for m in self._slot_of.values())
            need = min(
                self.max_capacity, -(-(longest_held + ROWS + 1) // self.bucket) * self.bucket
            )
            if need * 2 > self.capacity:
                return
        shape = (self.slots, self.spec.kv_heads, need, self.spec.head_dim)
        keep = min(need, self.capacity)
        pool = []
        for i in range(len(self.names)):
            new = np.zeros(shape, self.dtype)
            if self.pool and keep:
                new[:, :, :keep] = self.pool[i][:, :, :keep]
            pool.append(new)
        self.pool, self.capacity = pool, need
        self._bound.clear()  # bound to the old pool's buffers

    def _retire(self, m: Member, error: BaseException | None) -> None:
        r = m.run
        kv: KV | None = None
        tokens = list(r.hist)
        if error is None and m.slot is not None and self.pool:
            n = len(tokens)
            cap = -(-(n + ROWS) // self.bucket) * self.bucket
            ort = quiet_ort()
            bufs = []
            for src in self.pool:
                buf = np.zeros((1, self.spec.kv_heads, cap, self.spec.head_dim), self.dtype)
                buf[0, :, :n] = src[m.slot, :, :n]
                bufs.append(ort.OrtValue.ortvalue_from_numpy(buf))
            per = self.spec.kv_heads * cap * self.spec.head_dim * self.dtype.itemsize
            kv = KV(tuple(bufs), cap, len(bufs) * per)
        with self._cond:
            if m.slot is not None:
                self._slot_of.pop(m.slot, None)
                self._free.append(m.slot)
                self._free.sort()
                m.slot = None
            m.state = "gone"
            m.left_called = True
        r.done = True
        m.admitted.set()
        m.left(tokens, kv, error)

    def _decode(self) -> None:
        members = sorted(self._slot_of.items())
        ready: list[Member] = []
        for _, m in members:
            if m.stop or m.run.done or m.sent - m.taken >= self.credit:
                continue
            items: list[object] = []
            try:
                if self._sample(m, items):
                    ready.append(m)
            except BaseException as exc:
                m.post(items)
                self._retire(m, exc if isinstance(exc, EngineError) else EngineError(str(exc)))
                continue
            if items:
                m.sent += sum(isinstance(i, Step) for i in items)
                m.post(items)
        if not ready:
            return
        self._fit(max(len(m.run.hist) for m in ready))
        k = 1 + max(m.slot for m in ready if m.slot is not None)
        cap = self.capacity
        # A pass over two or more slots runs one row per slot: its weight GEMMs have k >= 2
        # rows, and a model that folds a KV group's queries into rows (the static demo
        # layout, query_group >= 2) gives attention >= 2 rows too, so no MatMul takes
        # ORT's one-row path. A lone slot keeps the pair [token, lookahead guess or pad].
        rows = 1 if self.single_row and k >= 2 else ROWS
        ids = np.full((k, rows), self.pad, np.int64)
        pos = np.full((k, rows), cap - 1, np.int64)
        for m in ready:
            assert m.slot is not None
            ids[m.slot, 0] = m.run.hist[m.row_pos]
            pos[m.slot, 0] = m.row_pos
            if rows == 1:
                m.row_guess = None
                continue
            if m.row_guess is not None:
                ids[m.slot, 1] = m.row_guess
            pos[m.slot, 1] = min(m.row_pos + 1, cap - 1)
        hidden = self.readout_layers if any(m.row_want for m in ready) else ()
        # the real rows attend over the slots up to the longest session (padding: at cap - 1)
        slots = attended_slots(max(m.row_pos for m in ready) + rows, cap)
        try:
            logits, states = self._pass(k, ids, pos, hidden, slots)
        except BaseException as exc:
            err = EngineError(f"onnxruntime run failed: {exc}")
            for m in ready:
                self._retire(m, err)
            return
        self.passes += 1
        self.shared_passes += len(ready) > 1
        self.occupancy = len(ready) / k
        for m in ready:
            self._finish_row(m, logits, states)

    def _sample(self, m: Member, items: list[object]) -> bool:
        """Sample ``m``'s next tokens until one needs a pass (True) or the session ends (False).

        A token that the previous pass already ran as its lookahead guess needs
        no pass: its logits are the guess row's, so sampling goes on.
        """
        r, params, options = m.run, m.params, m.options
        while m.sent + sum(isinstance(i, Step) for i in items) - m.taken < self.credit:
            p = len(r.hist)
            step, more, want = r.next_step(params, options)
            tok = step.token_id
            if not (want or more):
                r.done = True
                items.append(step)
                return False
            r.append(tok)
            g = r.guess
            r.guess = None
            if g is not None and g.tokens[0] == tok and not want:
                # the previous pass ran this token at this position: its next row is ours
                items.append(step)
                r.last = g.res.logits[0]
                m.stats.hits += 1
                items.append(_stats(m))
                if not more:
                    r.done = True
                    return False
                continue
            if not want:
                items.append(step)  # streamed before its pass runs
            guesses = r.guesses(1) if m.lookahead and p + 1 < self.max_capacity - 1 else []
            m.row_pos, m.row_guess, m.row_want = p, (guesses[0] if guesses else None), want
            m.row_step = step if want else None
            m.row_more = more
            return True
        return False

    def _finish_row(self, m: Member, logits: Any, states: dict[int, Any]) -> None:
        r = m.run
        assert m.slot is not None
        slot = m.slot
        r.last = np.array(logits[slot, 0])
        if m.row_guess is not None:
            guess_row = PassResult(
                logits=np.array(logits[slot, 1:2]), hidden={}, kv=r.base, end=m.row_pos + 2
            )
            r.guess = Guess(guess_row, m.row_pos + 1, [m.row_guess])
        m.stats.passes += 1
        m.stats.positions += 1
        items: list[object] = []
        if m.row_step is not None:
            assert m.readout is not None
            readout = m.readout({layer: states[layer][slot, 0] for layer in states})
            s = m.row_step
            items.append(
                Step(
                    token_id=s.token_id,
                    position=s.position,
                    is_prefill=False,
                    logprob=s.logprob,
                    top_logprobs=s.top_logprobs,
                    readout=readout,
                )
            )
            m.row_step = None
        if not m.row_more:
            r.done = True
        items.append(_stats(m))
        m.sent += sum(isinstance(i, Step) for i in items)
        m.post(items)

    def _pass(
        self, k: int, ids: Any, pos: Any, hidden_layers: Sequence[int], slots: int = 2**62
    ) -> tuple[Any, dict[int, Any]]:
        """One decode pass over slots ``[0, k)``: the logits ``[k, rows, vocab]`` (valid
        until the next pass) and the asked hidden states.

        A pass without hidden states reuses one I/O binding per (slots, rows)
        and pool, made on the first such pass: its inputs and logits are
        buffers written in place, so a pass costs ONNX Runtime's run and two
        small copies, not a new binding of every layer's past and present
        (about a third of a small model's decode step in Python, on the CPU).
        """
        if hidden_layers:
            return self._pass_fresh(k, ids, pos, hidden_layers, slots)
        bound = self._bound.get((k, ids.shape[1]))
        if bound is None:
            logits, states = self._pass_fresh(k, ids, pos, (), slots)
            self._bound[(k, ids.shape[1])] = self._bind(k, ids.shape[1], logits)
            return logits, states
        bound.ids[...] = ids
        bound.pos[...] = pos
        bound.slots[...] = slots
        self.sess.run_with_iobinding(bound.binding)
        return bound.logits, {}

    def _bind(self, k: int, rows: int, like: Any) -> _Bound:
        """The binding of :meth:`_pass` for ``k`` slots of ``rows`` rows, with logits
        shaped and typed as ``like``."""
        ort = quiet_ort()
        b = self.sess.io_binding()
        ids = np.empty((k, rows), np.int64)
        pos = np.empty((k, rows), np.int64)
        mask = np.ones((k, self.capacity), np.int64)
        slots = np.full(1, 2**62, np.int64)
        logits = np.empty_like(like)
        for name, arr in (("input_ids", ids), ("position_ids", pos), ("attention_mask", mask)):
            b.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(arr))
        self._bind_pool(b, k, slots)
        b.bind_ortvalue_output("logits", ort.OrtValue.ortvalue_from_numpy(logits))
        return _Bound(b, ids, pos, logits, mask, slots)

    def _bind_pool(self, b: Any, k: int, slots: Any = None) -> None:
        """Bind each layer's past and present to the pool's first ``k`` slots, in place, and
        ``slots`` (an int64 array [1], alive until the pass has run) as ``kv_slots``."""
        ort = quiet_ort()
        for past, present, t in zip(self.names, self.present, self.pool, strict=True):
            v = ort.OrtValue.ortvalue_from_numpy(t[:k])  # a view: written in place
            b.bind_ortvalue_input(past, v)
            b.bind_ortvalue_output(present, v)
        if slots is not None and self.kv_slots:
            b.bind_ortvalue_input(KV_SLOTS, ort.OrtValue.ortvalue_from_numpy(slots))

    def _pass_fresh(
        self, k: int, ids: Any, pos: Any, hidden_layers: Sequence[int], slots: int = 2**62
    ) -> tuple[Any, dict[int, Any]]:
        slots_in = np.array([slots], np.int64)
        return run_host_bound(
            self.sess,
            ids,
            pos,
            np.ones((k, self.capacity), np.int64),
            lambda b: self._bind_pool(b, k, slots_in),
            len(self.present),
            hidden_layers,
        )


@dataclass
class _Bound:
    """A reusable decode binding and the buffers it reads and writes."""

    binding: Any
    ids: np.ndarray
    pos: np.ndarray
    logits: np.ndarray
    #: bound as the attention mask (kept alive with the binding)
    mask: np.ndarray
    #: bound as ``kv_slots`` where the graph takes it
    slots: np.ndarray


def _stats(m: Member) -> Stats:
    s = m.stats
    m.stats = Stats()
    return s


def _succeed(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _fail(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
