"""An engine served from a process of its own (``[engine] process = "worker"``).

The server's event loop runs every transport, the log's writer and the
generation pipeline on one interpreter lock. An engine whose steps cost
Python time (sampling, binding, the reference engine's whole step) holds
that lock too, so the engine and the wires take turns instead of running at
once: with one message per token (Kakeya, Salience), a gRPC write costs
about as much as a reference-engine step, and the two in one process reach
a quarter of the engine's speed before the log adds anything
(docs/architecture.md, "The engine in a worker process").

:class:`WorkerEngine` is an :class:`~sessiontape.core.engine.interface.Engine` whose
work happens in a child process (``python -m sessiontape.core.engine.child``,
a fresh interpreter: the server has threads, so no fork) that loads the configured engine by name and serves it over a
pipe:

- ``generate`` starts a generation in the child, which streams its steps
  back in batches: a step is held at most ``flush_s`` for others to join
  it (``2 * flush_s`` when the generation's rest comes within that at its
  pace: then it ends in the batch, one run for the server), and not at all
  when steps come slower than that. The child runs at
  most ``window`` steps ahead of what the caller took (credit sent back
  as the caller takes them), so a slow consumer stops the engine instead
  of growing a queue.
- A caller that stops early (cancel, abort, client gone) tells the child
  how far it read; the child closes the engine's generator and rewinds
  the cache to the positions the caller took, as the engine contract asks
  (the child ran ahead of the caller).
- A generation's end carries the session's ``cached_length`` and the
  engine's ``kv_total_bytes`` as the child saw them then. The runtime asks
  for both as every generation ends (Kakeya INV-1, the KV gauge), so those
  answers come from here while nothing sent since has changed the
  session's cache (a ``gen``, ``stop``, ``rewind``, ``forget`` or ``fork``
  for its key makes the copy stale, and the next ask goes to the child).
  Asking the child blocks the event loop until the child reaches the call
  between its engine steps, which behind a fleet's generations is a large
  share of the loop's time.
- ``forget`` is sent without waiting: a session's cache going away answers
  nothing, and the pipe keeps it in order with what follows.
- The other methods (``rewind``, ``fork``, ``kv_live_bytes``,
  ``scheduler_stats``, ``image_block_length``, and ``cached_length`` when
  the copy is stale) are calls that wait for the child's answer. They are
  answered between the child's engine steps (ONNX passes run on the
  engine's own threads), so the wait is a pipe round trip or more. They
  come once per request at most, never per token.
- ``tokenize`` and ``detokenize`` run here, on the engine's
  :meth:`~sessiontape.core.engine.interface.Engine.text_codec` (sent over once at
  start), because transports call them per token; an engine without a
  codec is asked over the pipe.
- An error the engine raises in the child is raised here as the same
  :class:`~sessiontape.core.errors.SessiontapeError` class with the same
  message; anything else becomes :class:`EngineError`. A child that dies
  fails every running generation and every later call with
  :class:`EngineError`; the log is unaffected (steps are committed by the
  server, never by the engine), and the runtime's usual failure path
  records each generation's end.

Everything here runs on the event loop's thread (the pipe is not
thread-safe); the child is the only process that touches the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import itertools
import logging
import pickle
import select
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

from sessiontape.core.config import GenerationSettings
from sessiontape.core.engine.interface import (
    DEFAULT_OUTPUT,
    Engine,
    EngineInfo,
    OutputOptions,
    SamplingParams,
    Step,
    TextCodec,
)
from sessiontape.core.engine.pipe import Frames
from sessiontape.core.errors import ConfigError, EngineError, SessiontapeError

__all__ = ["WorkerEngine"]

log = logging.getLogger(__name__)

#: steps the child may run ahead of what the caller took
DEFAULT_WINDOW = 256
#: longest a ready step waits in the child for others to share its pipe write
DEFAULT_FLUSH_S = 0.0005
#: most steps in one pipe write
MAX_BATCH = 64
#: how long a call waits for the child's answer (a pass of a large prompt can take a while)
CALL_TIMEOUT_S = 120.0
#: how long the child may take to load its engine
START_TIMEOUT_S = 300.0

Wire = tuple[int, int, bool, float | None, tuple[tuple[int, float], ...], tuple[float, ...] | None]
#: a session's cache at a generation's end: (key, epoch, cached_length, kv_total_bytes)
State = tuple[str, int, int | None, int]


def wire(s: Step) -> Wire:
    return (s.token_id, s.position, s.is_prefill, s.logprob, s.top_logprobs, s.readout)


def error_parts(exc: BaseException) -> tuple[str, str, str, dict[str, Any]]:
    attrs = {
        k: v
        for k, v in vars(exc).items()
        if isinstance(v, str | int | float | bool | type(None) | tuple)
    }
    return (type(exc).__module__, type(exc).__qualname__, str(exc), attrs)


def _rebuild_error(parts: tuple[str, str, str, dict[str, Any]]) -> BaseException:
    """The child's error as raised here: its own class when that is a sessiontape error."""
    module, qualname, message, attrs = parts
    cls: Any = None
    with contextlib.suppress(Exception):
        cls = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
    if isinstance(cls, type) and issubclass(cls, SessiontapeError):
        exc = cls.__new__(cls)
        Exception.__init__(exc, message)
        exc.message = message
        exc.__dict__.update(attrs)
        return exc
    return EngineError(f"engine worker: {qualname}: {message}")


class _End:
    __slots__ = ("error",)

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


class WorkerEngine(Engine):
    """The engine ``name`` (built with ``options``) served from a child process."""

    def __init__(
        self,
        name: str,
        options: Mapping[str, Any] | None = None,
        *,
        window: int = DEFAULT_WINDOW,
        flush_s: float = DEFAULT_FLUSH_S,
        event_loop: str = "auto",
        short_hold_s: float | None = None,
    ) -> None:
        """``event_loop``: the child's, as ``[server] event_loop`` names the server's.
        ``short_hold_s``: the server's ``[generation] linger_s`` (its default when None),
        the longest the child holds a short generation's steps for its end to join them
        (core/engine/child.py, ``_Batch``)."""
        if short_hold_s is None:
            short_hold_s = GenerationSettings().linger_s
        if int(window) < 1 or not float(flush_s) >= 0:
            raise ConfigError(
                f"engine worker window must be >= 1 and flush_s >= 0, got {window}, {flush_s}"
            )
        self._window = int(window)
        # A fresh interpreter (not a fork: the server has threads), started as a module so
        # the server's own __main__ is never imported again there.
        mine, theirs = socket.socketpair()
        with mine, theirs:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "sessiontape.core.engine.child", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
            self._conn = Connection(mine.detach())
        # the server's import path too, so a ``module:Class`` engine it can import loads there
        start = (
            "start",
            name,
            dict(options or {}),
            self._window,
            float(flush_s),
            list(sys.path),
            event_loop,
            float(short_hold_s),
        )
        self._conn.send(start)
        self._ids = itertools.count(1)
        #: running generations' inboxes, by generation id
        self._inboxes: dict[int, asyncio.Queue[list[Wire] | _End]] = {}
        #: set once the child is gone (or closed): every later call raises it
        self._broken: EngineError | None = None
        #: per session key, the number of the latest message sent that changes its cache
        #: (numbered across keys, so a key forgotten and used again never repeats one)
        self._epochs: dict[str, int] = {}
        self._epoch_ids = itertools.count(1)
        #: per session key, (epoch, cached_length) the child reported at a generation's end
        self._cached: dict[str, tuple[int, int | None]] = {}
        #: the engine's kv_total_bytes at the latest generation's end, once one ended
        self._kv_total: int | None = None
        #: per session key, the history its latest generation was sent with (the child
        #: keeps the same): a turn sends what it adds to it, not the whole history
        self._sent: dict[str, list[int]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        try:
            if not self._conn.poll(START_TIMEOUT_S):
                raise EngineError(
                    f"engine worker for {name!r} did not start in {START_TIMEOUT_S:.0f} s"
                )
            msg = self._conn.recv()
        except (EOFError, OSError) as exc:
            self._kill()
            raise EngineError(
                f"engine worker for {name!r} exited while starting (code {self._proc.returncode})"
            ) from exc
        except BaseException:
            self._kill()
            raise
        if msg[0] == "err":
            self._kill()
            raise _rebuild_error(msg[2])
        _, self._info, self._batches, self._codec = msg
        self._frames = Frames(self._conn.fileno())

    # -- plumbing ------------------------------------------------------------

    def _kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(5)

    def _send(self, msg: tuple[Any, ...]) -> None:
        if self._broken is not None:
            raise self._broken
        try:
            # pickle.dumps, not Connection.send's ForkingPickler, which builds a BytesIO and
            # a pickler a message (a third more time for a generation's start)
            self._conn.send_bytes(pickle.dumps(msg, pickle.HIGHEST_PROTOCOL))
        except (OSError, ValueError) as exc:
            self._fail()
            raise EngineError("engine worker is gone") from exc

    def _fail(self) -> None:
        """The child is gone: end every generation and refuse every later call."""
        if self._broken is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(1)
            self._broken = EngineError(
                f"engine worker process exited (code {self._proc.returncode})"
            )
            log.error("%s", self._broken)
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._conn.fileno())
        for inbox in self._inboxes.values():
            inbox.put_nowait(_End(self._broken))

    def _dispatch(self, msg: tuple[Any, ...]) -> None:
        kind, gid = msg[0], msg[1]
        inbox = self._inboxes.get(gid)
        if inbox is None:
            return  # a generation the caller already left
        if kind == "steps":
            inbox.put_nowait(msg[2])
        elif kind == "end":
            self._note_state(msg[3])
            inbox.put_nowait(_End(None if msg[2] is None else _rebuild_error(msg[2])))

    def _touch(self, key: str) -> int:
        """A message that changes ``key``'s cache is being sent: the copy is stale."""
        epoch = self._epochs[key] = next(self._epoch_ids)
        self._cached.pop(key, None)
        return epoch

    def _note_state(self, state: State | None) -> None:
        """A generation's end as the child saw it: kept while nothing changed it since."""
        if state is None:
            return  # the child could not read it: the next ask goes there
        key, epoch, cached, kv_total = state
        self._kv_total = kv_total
        if self._epochs.get(key) == epoch:
            self._cached[key] = (epoch, cached)

    def _readable(self) -> None:
        try:
            msgs = self._frames.read()
        except (EOFError, OSError):
            self._fail()
            return
        for msg in msgs:
            self._dispatch(msg)

    def _ensure_reader(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._conn.fileno())
        self._loop = loop
        loop.add_reader(self._conn.fileno(), self._readable)

    def _call(self, method: str, *args: Any) -> Any:
        """``method(*args)`` on the child's engine, waiting for the answer (stream
        messages that arrive meanwhile go to their generations)."""
        rid = next(self._ids)
        self._send(("call", rid, method, args))
        deadline = time.monotonic() + CALL_TIMEOUT_S
        fd = self._conn.fileno()
        answer: tuple[Any, ...] | None = None
        try:
            while answer is None:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    raise EngineError(
                        f"engine worker did not answer {method} in {CALL_TIMEOUT_S:.0f} s"
                    )
                for msg in self._frames.read():
                    if msg[0] in ("ret", "err") and msg[1] == rid:
                        answer = msg
                    else:
                        self._dispatch(msg)  # stream messages that came first
        except (EOFError, OSError) as exc:
            self._fail()
            raise EngineError("engine worker is gone") from exc
        if answer[0] == "err":
            raise _rebuild_error(answer[2])
        return answer[2]

    # -- the Engine ABC ------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        return self._info  # type: ignore[no-any-return]

    @property
    def batches(self) -> bool:
        return bool(self._batches)

    def text_codec(self) -> TextCodec | None:
        return self._codec  # type: ignore[no-any-return]

    def failure(self) -> str | None:
        if self._broken is None and self._proc.poll() is not None:
            self._fail()  # died while idle: nothing read its pipe's end yet
        return None if self._broken is None else str(self._broken)

    def tokenize(self, text: str) -> list[int]:
        if self._codec is not None:
            return list(self._codec.encode(text))
        return list(self._call("tokenize", text))

    def detokenize(self, tokens: Sequence[int]) -> str:
        if self._codec is not None:
            return str(self._codec.decode(tokens))
        return str(self._call("detokenize", list(tokens)))

    async def generate(
        self,
        session_key: str,
        history: Sequence[int],
        params: SamplingParams,
        options: OutputOptions = DEFAULT_OUTPUT,
    ) -> AsyncIterator[Step]:
        self._ensure_reader()
        gid = next(self._ids)
        inbox: asyncio.Queue[list[Wire] | _End] = asyncio.Queue()
        self._inboxes[gid] = inbox
        hist = list(history)
        keep = len(hist)  # the cache the caller may rely on: history + generated steps taken
        taken = acked = 0
        ended = False
        half = max(1, self._window // 2)
        try:
            epoch = self._touch(session_key)
            base = self._sent.get(session_key)
            kept = len(base) if base is not None and hist[: len(base)] == base else 0
            self._sent[session_key] = hist
            self._send(("gen", gid, session_key, epoch, kept, hist[kept:], params, options))
            while True:
                item = await inbox.get()
                if isinstance(item, _End):
                    ended = True
                    if item.error is not None:
                        raise item.error
                    return
                for w in item:
                    step = Step(*w)
                    if not step.is_prefill:
                        keep = step.position + 1
                    yield step
                    taken += 1
                if taken - acked >= half:
                    acked = taken
                    self._send(("credit", gid, taken))
        finally:
            self._inboxes.pop(gid, None)
            if not ended and self._broken is None:
                # the child ran ahead of the caller: stop it and trim what was not taken
                with contextlib.suppress(EngineError):
                    self._touch(session_key)
                    self._send(("stop", gid, session_key, keep))

    def fork(self, parent_key: str, child_key: str, at_position: int) -> None:
        self._touch(child_key)
        self._call("fork", parent_key, child_key, at_position)

    def forget(self, session_key: str) -> None:
        if self._broken is None:
            self._cached.pop(session_key, None)
            self._epochs.pop(session_key, None)
            self._sent.pop(session_key, None)
            self._send(("forget", session_key))

    def rewind(self, session_key: str, length: int) -> None:
        self._touch(session_key)
        self._call("rewind", session_key, length)

    def kv_live_bytes(self, session_key: str) -> int:
        return int(self._call("kv_live_bytes", session_key))

    def kv_total_bytes(self) -> int:
        if self._kv_total is not None and self._broken is None:
            return self._kv_total
        return int(self._call("kv_total_bytes"))

    def scheduler_stats(self) -> Mapping[str, float]:
        if not self._batches or self._broken is not None:
            return {}
        return dict(self._call("scheduler_stats"))

    def cached_length(self, session_key: str) -> int | None:
        known = self._cached.get(session_key)
        if known is not None and self._broken is None:
            return known[1]
        value = self._call("cached_length", session_key)
        return None if value is None else int(value)

    def image_block_length(self, image: bytes, mime: str) -> int:
        return int(self._call("image_block_length", image, mime))

    async def aclose(self) -> None:
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._conn.fileno())
        if self._broken is None and self._proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self._conn.send(("close",))
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.get_running_loop().run_in_executor(None, self._proc.wait, 30)
        self._kill()
        self._broken = self._broken or EngineError("engine worker is closed")
        for inbox in self._inboxes.values():
            inbox.put_nowait(_End(self._broken))
        self._conn.close()
        self._frames.close()
