"""An engine served from a process of its own (``[engine] process = "worker"``).

The server's event loop runs every transport, the log's writer and the
generation pipeline on one interpreter lock. An engine whose steps cost
Python time (sampling, binding, the reference engine's whole step) holds
that lock too, so the engine and the wires take turns instead of running at
once: with one message per token (Kakeya, Salience), a gRPC write costs
about as much as a reference-engine step, and the two in one process reach
a quarter of the engine's speed before the log adds anything
(docs/architecture.md, "The engine in a worker process").

:class:`WorkerEngine` is an :class:`~sessiontape.core.engine.Engine` whose
work happens in a child process (``python -m sessiontape.core.engine.worker``,
a fresh interpreter: the server has threads, so no fork) that loads the configured engine by name and serves it over a
pipe:

- ``generate`` starts a generation in the child, which streams its steps
  back in batches: a step is held at most ``flush_s`` for others to join
  it, and not at all when steps come slower than that. The child runs at
  most ``window`` steps ahead of what the caller took (credit sent back
  as the caller takes them), so a slow consumer stops the engine instead
  of growing a queue.
- A caller that stops early (cancel, abort, client gone) tells the child
  how far it read; the child closes the engine's generator and rewinds
  the cache to the positions the caller took, as the engine contract asks
  (the child ran ahead of the caller).
- The other methods (``rewind``, ``forget``, ``fork``, ``cached_length``,
  ``kv_*``, ``scheduler_stats``, ``image_block_length``) are calls that
  wait for the child's answer. They are answered between the child's
  engine steps (ONNX passes run on the engine's own threads), so the wait
  is a pipe round trip. They come once per generation or request, never
  per token.
- ``tokenize`` and ``detokenize`` run here, on the engine's
  :meth:`~sessiontape.core.engine.Engine.text_codec` (sent over once at
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
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

from sessiontape.core.engine import (
    DEFAULT_OUTPUT,
    Engine,
    EngineInfo,
    OutputOptions,
    SamplingParams,
    Step,
    TextCodec,
)
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

_Wire = tuple[int, int, bool, float | None, tuple[tuple[int, float], ...], tuple[float, ...] | None]


def _wire(s: Step) -> _Wire:
    return (s.token_id, s.position, s.is_prefill, s.logprob, s.top_logprobs, s.readout)


def _error_parts(exc: BaseException) -> tuple[str, str, str, dict[str, Any]]:
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
    ) -> None:
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
                [sys.executable, "-m", "sessiontape.core.engine.worker", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
            self._conn = Connection(mine.detach())
        # the server's import path too, so a ``module:Class`` engine it can import loads there
        start = ("start", name, dict(options or {}), self._window, float(flush_s), list(sys.path))
        self._conn.send(start)
        self._ids = itertools.count(1)
        #: running generations' inboxes, by generation id
        self._inboxes: dict[int, asyncio.Queue[list[_Wire] | _End]] = {}
        #: set once the child is gone (or closed): every later call raises it
        self._broken: EngineError | None = None
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
            self._conn.send(msg)
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
            inbox.put_nowait(_End(None if msg[2] is None else _rebuild_error(msg[2])))

    def _readable(self) -> None:
        conn = self._conn
        try:
            while conn.poll():
                self._dispatch(conn.recv())
        except (EOFError, OSError):
            self._fail()

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
        conn = self._conn
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not conn.poll(left):
                    raise EngineError(
                        f"engine worker did not answer {method} in {CALL_TIMEOUT_S:.0f} s"
                    )
                msg = conn.recv()
                if msg[0] in ("ret", "err") and msg[1] == rid:
                    if msg[0] == "err":
                        raise _rebuild_error(msg[2])
                    return msg[2]
                self._dispatch(msg)
        except (EOFError, OSError) as exc:
            self._fail()
            raise EngineError("engine worker is gone") from exc

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
        inbox: asyncio.Queue[list[_Wire] | _End] = asyncio.Queue()
        self._inboxes[gid] = inbox
        hist = list(history)
        keep = len(hist)  # the cache the caller may rely on: history + generated steps taken
        taken = acked = 0
        ended = False
        half = max(1, self._window // 2)
        try:
            self._send(("gen", gid, session_key, hist, params, options))
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
                    self._send(("stop", gid, session_key, keep))

    def fork(self, parent_key: str, child_key: str, at_position: int) -> None:
        self._call("fork", parent_key, child_key, at_position)

    def forget(self, session_key: str) -> None:
        if self._broken is None:
            self._call("forget", session_key)

    def rewind(self, session_key: str, length: int) -> None:
        self._call("rewind", session_key, length)

    def kv_live_bytes(self, session_key: str) -> int:
        return int(self._call("kv_live_bytes", session_key))

    def kv_total_bytes(self) -> int:
        return int(self._call("kv_total_bytes"))

    def scheduler_stats(self) -> Mapping[str, float]:
        if not self._batches or self._broken is not None:
            return {}
        return dict(self._call("scheduler_stats"))

    def cached_length(self, session_key: str) -> int | None:
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


# -- the child ---------------------------------------------------------------

_CALLS = frozenset(
    {
        "tokenize",
        "detokenize",
        "fork",
        "forget",
        "rewind",
        "kv_live_bytes",
        "kv_total_bytes",
        "scheduler_stats",
        "cached_length",
        "image_block_length",
    }
)


def main(argv: Sequence[str] | None = None) -> None:
    """The worker process (``python -m sessiontape.core.engine.worker FD``): load the
    engine named in the first message, then serve it until told to close or the
    server's end of the pipe goes away."""
    args = sys.argv[1:] if argv is None else argv
    conn = Connection(int(args[0]))
    try:
        _, name, options, window, flush_s, path = conn.recv()
        sys.path[:] = [*path, *(p for p in sys.path if p not in path)]
        from sessiontape.core.registry import ENGINES, load

        engine: Engine = load(ENGINES, name)(**options)
        conn.send(("ready", engine.info, engine.batches, engine.text_codec()))
    except BaseException as exc:  # reported to the server, which raises it
        with contextlib.suppress(Exception):
            conn.send(("err", 0, _error_parts(exc)))
        return
    asyncio.run(_Child(conn, engine, window, flush_s).serve())


class _Run:
    """One generation in the child."""

    def __init__(self) -> None:
        self.acked = 0
        self.credit = asyncio.Event()
        self.task: asyncio.Task[None] | None = None


class _Child:
    def __init__(self, conn: Connection, engine: Engine, window: int, flush_s: float) -> None:
        self.conn = conn
        self.engine = engine
        self.window = window
        self.flush_s = flush_s
        self.runs: dict[int, _Run] = {}
        self.inbox: asyncio.Queue[tuple[Any, ...] | None] = asyncio.Queue()
        # Writes go through a thread of their own: a write the server is slow to read
        # (it may itself be blocked writing a long history here) must not stop this
        # loop from reading, or both ends would wait on each other.
        self.outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.writer = threading.Thread(target=self._write, name="engine-worker-writer", daemon=True)
        self.writer.start()

    def send(self, msg: tuple[Any, ...]) -> None:
        self.outbox.put(pickle.dumps(msg, pickle.HIGHEST_PROTOCOL))

    def _write(self) -> None:
        while (data := self.outbox.get()) is not None:
            try:
                self.conn.send_bytes(data)
            except OSError:
                return  # the server is gone; the reader sees it too

    def _readable(self) -> None:
        try:
            while self.conn.poll():
                self.inbox.put_nowait(self.conn.recv())
        except (EOFError, OSError):
            self.inbox.put_nowait(None)  # the server is gone

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_reader(self.conn.fileno(), self._readable)
        try:
            while True:
                msg = await self.inbox.get()
                if msg is None or msg[0] == "close":
                    break
                await self.handle(msg)
        finally:
            loop.remove_reader(self.conn.fileno())
            self.outbox.put(None)
            for run in list(self.runs.values()):
                if run.task is not None:
                    run.task.cancel()
            await asyncio.gather(
                *(r.task for r in self.runs.values() if r.task is not None), return_exceptions=True
            )
            with contextlib.suppress(Exception):
                await self.engine.aclose()
            self.writer.join(5)

    async def handle(self, msg: tuple[Any, ...]) -> None:
        """One message, in order: a stop settles before a later call is answered."""
        kind = msg[0]
        if kind == "call":
            _, rid, method, args = msg
            try:
                if method not in _CALLS:
                    raise EngineError(f"no engine call {method!r}")
                self.send(("ret", rid, getattr(self.engine, method)(*args)))
            except Exception as exc:
                self.send(("err", rid, _error_parts(exc)))
        elif kind == "gen":
            _, gid, key, history, params, options = msg
            run = self.runs[gid] = _Run()
            run.task = asyncio.create_task(self.generate(gid, run, key, history, params, options))
        elif kind == "credit":
            run_ = self.runs.get(msg[1])
            if run_ is not None:
                run_.acked = max(run_.acked, int(msg[2]))
                run_.credit.set()
        elif kind == "stop":
            _, gid, key, keep = msg
            stopped = self.runs.pop(gid, None)
            if stopped is not None and stopped.task is not None:
                stopped.task.cancel()
                with contextlib.suppress(BaseException):
                    await stopped.task
            try:
                self.engine.rewind(key, int(keep))
            except Exception:
                log.exception("engine worker: rewinding %s to %s after a stop", key, keep)

    async def generate(
        self,
        gid: int,
        run: _Run,
        key: str,
        history: list[int],
        params: SamplingParams,
        options: OutputOptions,
    ) -> None:
        loop = asyncio.get_running_loop()
        steps = self.engine.generate(key, history, params, options)
        batch: list[_Wire] = []
        produced = 0
        timer: asyncio.TimerHandle | None = None
        last = time.perf_counter()
        interval: float | None = None

        def flush() -> None:
            nonlocal timer
            if timer is not None:
                timer.cancel()
                timer = None
            if batch:
                self.send(("steps", gid, batch.copy()))
                batch.clear()

        try:
            async for step in steps:
                now = time.perf_counter()
                interval = now - last if interval is None else 0.8 * interval + 0.2 * (now - last)
                last = now
                batch.append(_wire(step))
                produced += 1
                if interval * 2 > self.flush_s or len(batch) >= MAX_BATCH:
                    flush()  # steps come slowly (or enough wait): none is held
                elif timer is None:
                    timer = loop.call_later(self.flush_s, flush)
                while produced - run.acked >= self.window:
                    flush()
                    run.credit.clear()
                    await run.credit.wait()
                    last = time.perf_counter()  # the wait is not the engine's pace
            flush()
            self.send(("end", gid, None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            flush()
            self.send(("end", gid, _error_parts(exc)))
        finally:
            if timer is not None:
                timer.cancel()
            self.runs.pop(gid, None)
            with contextlib.suppress(Exception):
                await steps.aclose()  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
