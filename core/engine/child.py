"""The engine worker's child process: ``python -m sessiontape.core.engine.child FD``.

It loads the engine named in the server's first message and serves it over the
pipe (core/engine/worker.py says what the server sends and what comes back):
generations stream their steps in batches within a credit window and end with
the session's cache state; calls are answered between engine steps; a stop
rewinds the cache to what the server took.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from sessiontape.core.engine.interface import Engine, OutputOptions, SamplingParams, Step
from sessiontape.core.engine.pipe import Frames, Outbox
from sessiontape.core.engine.worker import (
    MAX_BATCH,
    State,
    Wire,
    error_parts,
    wire,
)
from sessiontape.core.errors import EngineError
from sessiontape.core.generation.policy import SHORT_GENERATION

log = logging.getLogger(__name__)

#: how long the child's last writes may wait for the server as it closes
CLOSE_TIMEOUT_S = 5.0

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
    """The worker process (``python -m sessiontape.core.engine.child FD``): load the
    engine named in the first message, then serve it until told to close or the
    server's end of the pipe goes away."""
    args = sys.argv[1:] if argv is None else argv
    conn = Connection(int(args[0]))
    try:
        _, name, options, window, flush_s, path, event_loop, short_hold_s = conn.recv()
        sys.path[:] = [*path, *(p for p in sys.path if p not in path)]
        from sessiontape.core.commands.serve import loop_factory
        from sessiontape.core.plugins import ENGINES, load

        factory = loop_factory(event_loop)  # the server's choice (uvloop: less CPU a message)
        engine: Engine = load(ENGINES, name)(**options)
        conn.send(("ready", engine.info, engine.batches, engine.text_codec()))
    except BaseException as exc:  # reported to the server, which raises it
        with contextlib.suppress(Exception):
            conn.send(("err", 0, error_parts(exc)))
        return
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(_serve(conn, engine, window, flush_s, short_hold_s))


async def _serve(
    conn: Connection, engine: Engine, window: int, flush_s: float, short_hold_s: float
) -> None:
    await _Child(conn, engine, window, flush_s, short_hold_s).serve()


class _Run:
    """One generation in the child."""

    def __init__(self) -> None:
        self.acked = 0
        self.credit = asyncio.Event()
        self.task: asyncio.Task[None] | None = None


class _Batch:
    """One generation's steps not yet written, and when they are.

    A step is held at most ``flush_s`` for others to share its write, and not at all
    when steps come slower than that. A batch whose generation's rest comes within
    ``2 * flush_s`` of its first step at the pace so far is held to the end: the
    server takes it as one run, one commit. A short generation (at most
    ``SHORT_GENERATION`` steps) whose rest comes within the child's ``short_hold_s``
    (the server's own ``[generation] linger_s`` for more steps) is held to its end too, however its steps
    compare with ``flush_s``: the runtime commits it as one run anyway, and its steps
    went one a write, each a read and a wake-up for the server.
    """

    def __init__(self, child: _Child, gid: int, max_tokens: int) -> None:
        self.child, self.gid, self.max_tokens = child, gid, max_tokens
        self.steps: list[Wire] = []
        self.produced = 0
        self.timer: asyncio.TimerHandle | None = None
        self.last = time.perf_counter()
        self.interval: float | None = None
        self.held_since = 0.0
        self.holding = False  # held to the end, its rest within 2 * flush_s
        self.held_short = False  # held to the end as a short generation

    def left_s(self, interval: float) -> float:
        """How long the generation's remaining steps take at this pace."""
        return max(0, self.max_tokens - self.produced) * interval

    def add(self, step: Step) -> None:
        now = time.perf_counter()
        dt = now - self.last
        interval = self.interval = dt if self.interval is None else 0.8 * self.interval + 0.2 * dt
        self.last = now
        self.steps.append(wire(step))
        self.produced += 1
        flush_s = self.child.flush_s
        if len(self.steps) >= MAX_BATCH:
            self.flush()
        elif (
            self.max_tokens <= SHORT_GENERATION and self.left_s(interval) <= self.child.short_hold_s
        ):
            if not self.held_short:
                self._later(2 * self.child.short_hold_s)  # a backstop, should the engine stall
                self.held_short = True
        elif self.held_short or interval * 2 > flush_s:
            self.flush()  # steps come slowly (or a short hold's pace fell): none is held
        elif self.timer is None:
            self._later(flush_s)
            self.held_since, self.holding = now, False
        elif not self.holding and now - self.held_since >= flush_s:
            self.flush()  # held its time while steps kept coming (the timer is coarser)
        elif not self.holding and now - self.held_since + self.left_s(interval) <= 2 * flush_s:
            self._later(2 * flush_s - (now - self.held_since))
            self.holding = True

    def waited(self) -> None:
        """The generation waited for credit: that wait is not the engine's pace."""
        self.last = time.perf_counter()

    def _later(self, delay_s: float) -> None:
        """A flush in ``delay_s``, 1 ms at the least: uvloop's timers count whole
        milliseconds and would run one of 0.5 ms at once, sending every step alone (the
        batch's own time is checked as each step comes, in :meth:`add`)."""
        if self.timer is not None:
            self.timer.cancel()
        self.timer = asyncio.get_running_loop().call_later(max(delay_s, 0.001), self.flush)

    def flush(self) -> None:
        self.held_short = False
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.steps:
            self.child.send(("steps", self.gid, self.steps))
            self.steps = []

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class _Child:
    def __init__(
        self, conn: Connection, engine: Engine, window: int, flush_s: float, short_hold_s: float
    ) -> None:
        self.conn = conn
        self.engine = engine
        self.window = window
        self.flush_s = flush_s
        self.short_hold_s = short_hold_s
        self.runs: dict[int, _Run] = {}
        #: per session key, the history of its latest generation: the server sends a
        #: generation what it adds to that (``kept`` positions of it, then the rest)
        self.histories: dict[str, tuple[int, ...]] = {}
        self.inbox: asyncio.Queue[tuple[Any, ...] | None] = asyncio.Queue()
        self.frames = Frames(conn.fileno())
        # Writes never block this loop (pipe.Outbox): a write the server is slow to read
        # (it may itself be blocked writing a long history here) must not stop this loop
        # from reading, or both ends would wait on each other.
        self.outbox = Outbox(conn.fileno(), asyncio.get_running_loop())

    def send(self, msg: tuple[Any, ...]) -> None:
        self.outbox.put(msg)

    def _readable(self) -> None:
        try:
            for msg in self.frames.read():
                self.inbox.put_nowait(msg)
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(self.conn.fileno())
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
            for run in list(self.runs.values()):
                if run.task is not None:
                    run.task.cancel()
            await asyncio.gather(
                *(r.task for r in self.runs.values() if r.task is not None), return_exceptions=True
            )
            with contextlib.suppress(Exception):
                await self.engine.aclose()
            self.outbox.close(CLOSE_TIMEOUT_S)
            self.frames.close()

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
                self.send(("err", rid, error_parts(exc)))
        elif kind == "gen":
            _, gid, key, epoch, kept, added, params, options = msg
            history = [*self.histories.get(key, ())[:kept], *added]
            self.histories[key] = tuple(history)  # the engine may keep or change its list
            run = self.runs[gid] = _Run()
            run.task = asyncio.create_task(
                self.generate(gid, run, (key, epoch), history, params, options)
            )
        elif kind == "forget":
            self.histories.pop(msg[1], None)
            try:
                self.engine.forget(msg[1])
            except Exception:
                log.exception("engine worker: forgetting %s", msg[1])
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
        keyed: tuple[str, int],
        history: list[int],
        params: SamplingParams,
        options: OutputOptions,
    ) -> None:
        """Stream one generation's steps; its end carries the session's cache state
        (``keyed``: the session key and the epoch the server sent it with)."""
        steps = self.engine.generate(keyed[0], history, params, options)
        batch = _Batch(self, gid, params.max_tokens)
        try:
            async for step in steps:
                batch.add(step)
                while batch.produced - run.acked >= self.window:
                    batch.flush()
                    run.credit.clear()
                    await run.credit.wait()
                    batch.waited()
            batch.flush()
            self.send(("end", gid, None, self._state(keyed)))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            batch.flush()
            self.send(("end", gid, error_parts(exc), self._state(keyed)))
        finally:
            batch.close()
            self.runs.pop(gid, None)
            with contextlib.suppress(Exception):
                await steps.aclose()  # type: ignore[attr-defined]

    def _state(self, keyed: tuple[str, int]) -> State | None:
        """The session's cache as of now, for the server's copy (None if it cannot be read)."""
        try:
            cached = self.engine.cached_length(keyed[0])
            return (
                keyed[0],
                keyed[1],
                None if cached is None else int(cached),
                int(self.engine.kv_total_bytes()),
            )
        except Exception:
            return None


if __name__ == "__main__":
    main()
