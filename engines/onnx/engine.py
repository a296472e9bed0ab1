"""The ONNX Runtime engine.

Usage::

    engine = OnnxEngine()                       # the tiny demo model, built on first use
    engine = OnnxEngine(model="smollm2-135m-instruct")   # a real model (imported on first use)
    engine = OnnxEngine(model_dir="/models/x", providers="auto", kv_cache_bytes=1 << 30)

Options (keywords, or ``[engine.options]`` in the config) are declared, with
their defaults and bounds, by :class:`sessiontape.engines.onnx.options.OnnxOptions`
(docs/configuration.md lists them). With none of ``model``, ``model_dir`` and
``size``, the engine serves the registry's default model (SmolLM2-135M-Instruct)
when its package is installed (``scripts/setup`` installs it), and otherwise the
tiny demo model. Opening the model (its session, runner and batch scheduler) is
:mod:`sessiontape.engines.onnx.loading`'s job; this module generates: the
prefill of what the KV cache does not hold, then decoding, in the thread that
runs passes a hop at a time or by the batch scheduler.

See docs/engines.md for why results are bit-identical however a history
was built up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Callable,
    Iterator,
    Mapping,
    Sequence,
)
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from sessiontape.core.constraint import Constraint
from sessiontape.core.engine.interface import (
    Engine,
    EngineInfo,
    OutputOptions,
    SamplingParams,
    Step,
    TextCodec,
)
from sessiontape.core.errors import ConfigError, ContextOverflow, InvalidParameters
from sessiontape.core.settings_framework import load_section
from sessiontape.engines.constrained import TokenMasks
from sessiontape.engines.onnx.batch import BatchScheduler, Member, Stats
from sessiontape.engines.onnx.kvcache import KV, KVCache, common_prefix
from sessiontape.engines.onnx.loading import load_model
from sessiontape.engines.onnx.model import Concepts, GraphSpec, constraint_tokenizer
from sessiontape.engines.onnx.options import OnnxOptions
from sessiontape.engines.onnx.run import HOP_END, Guess, Run, Stored
from sessiontape.engines.onnx.runner import PassResult, Runner
from sessiontape.engines.onnx.static import StaticRunner
from sessiontape.engines.sampling import log_softmax, top_logprobs

log = logging.getLogger("sessiontape.engines.onnx")


class OnnxEngine(Engine):
    options_class = OnnxOptions

    def __init__(self, options: OnnxOptions | None = None, **kwargs: Any) -> None:
        """``OnnxEngine(model_dir=..., providers="auto")``, or from :class:`OnnxOptions`;
        ConfigError for a bad option, before any model is imported or opened."""
        if options is not None and kwargs:
            raise ConfigError("give the onnx engine options or keywords, not both")
        o = options or load_section(OnnxOptions, kwargs, "engine.options")
        loaded = load_model(o)
        self._sess = loaded.sess
        self.spec: GraphSpec = loaded.spec
        self.runner: Runner | StaticRunner = loaded.runner
        self.concepts: Concepts | None = loaded.concepts
        self._tok = loaded.tokenizer
        self.prefill_chunk = loaded.prefill_chunk
        self.decode_batch = o.decode_batch
        self.lookahead = o.lookahead
        #: decode steps whose token had already been run as the previous pass's guess
        self.lookahead_hits = 0
        self._readout_layers = () if self.concepts is None else self.concepts.manifest.layers
        self.cache = KVCache(o.kv_cache_bytes, on_free=self.runner.release)
        self._pool = ThreadPoolExecutor(max_workers=o.workers, thread_name_prefix="onnx-engine")
        self._batch: BatchScheduler | None = loaded.batch
        if self._batch is not None:
            # an engine dropped without aclose() must not leave its thread (and model) behind
            weakref.finalize(self, self._batch.shutdown)
        #: new positions run through the model (padding and re-run rows excluded), and forward passes
        self.positions_computed = 0
        self.passes = 0
        self.model_dir = loaded.folder
        self._info = loaded.info
        self._masks = TokenMasks(
            lambda: constraint_tokenizer(self._tok, self._info.vocab_size, self._info.eos_token_ids)
        )
        log.info(
            "onnx engine: %s on %s (onnxruntime %s, io_binding=%s)",
            self._info.model_id,
            self._info.provider,
            self._info.runtime_version,
            self._info.extra["io_binding"],
        )

    @property
    def info(self) -> EngineInfo:
        return self._info

    def check_constraint(self, constraint: Constraint, history: Sequence[int]) -> None:
        self._masks.start(constraint, history)

    def text_codec(self) -> TextCodec:
        return self._tok

    @classmethod
    def recorded_codec(cls, binding: Mapping[str, Any]) -> TextCodec | None:
        from sessiontape.engines.onnx.recorded import recorded_tokenizer

        return recorded_tokenizer(binding)

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self._tok.decode(tokens)

    # -- cache hints -------------------------------------------------------

    def fork(self, parent_key: str, child_key: str, at_position: int) -> None:
        self.cache.fork(parent_key, child_key, at_position)

    def forget(self, session_key: str) -> None:
        self.cache.forget(session_key)

    def rewind(self, session_key: str, length: int) -> None:
        e = self.cache.get(session_key)
        if e is not None and e.kv is not None and 0 <= length < e.length:
            self.cache.truncate(e, length, keep_buffer=self.runner.static)

    def kv_live_bytes(self, session_key: str) -> int:
        return self.cache.live_bytes(session_key)

    def kv_total_bytes(self) -> int:
        pool = 0 if self._batch is None else self._batch.pool_bytes()
        return int(self.cache.total_bytes) + pool

    @property
    def batches(self) -> bool:
        return self._batch is not None

    def scheduler_stats(self) -> dict[str, float]:
        return {} if self._batch is None else self._batch.stats()

    def cached_length(self, session_key: str) -> int | None:
        return self.cache.cached_length(session_key)

    async def aclose(self) -> None:
        if self._batch is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._batch.close)
        self._pool.shutdown(wait=True)

    def _in_worker(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        """Run a pass in the thread that runs passes (the batch scheduler's, when batching)."""
        if self._batch is not None:
            return self._batch.submit(fn, *args)
        return asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # -- generation --------------------------------------------------------

    def _advance(
        self,
        r: Run,
        upto: int,
        hidden_layers: Sequence[int],
        guesses: Sequence[int] = (),
        logits_at: int = 0,
    ) -> tuple[PassResult, int]:
        """Run ``r.hist[r.base_len:upto]`` (then ``guesses``) on ``r.base``; returns the pass and its first position.

        Runs in a worker thread. A pass whose rows are all real becomes the
        next base as it is, so steady decoding alternates [token, pad] and
        [previous token again, token] passes and never copies the KV to drop
        a padding row. ``logits_at``: the first position whose logits the caller reads (a
        runner may skip the output head on the rows before it; ``PassResult.row_logits``).
        """
        start = r.base_len
        if r.base.length != start and not self.runner.static:
            r.base = self.runner.trim(r.base, start)
        res = self.runner.run(
            r.base,
            start,
            [*r.hist[start:upto], *guesses],
            tuple(hidden_layers),
            max(0, logits_at - start),
        )
        if res.end == upto or self.runner.static:
            # a static buffer holds every real position the pass wrote; padding lies past them
            r.base, r.base_len = res.kv, upto
        return res, start

    def _decode_hop(
        self,
        r: Run,
        params: SamplingParams,
        options: OutputOptions,
        post: Callable[[list[object]], None],
    ) -> None:
        """Up to ``decode_batch`` decode steps in a worker thread.

        Items are posted to the loop in one batch just before each pass
        starts, so a step is streamed while the pass after it runs and the
        loop thread wakes once per pass, not once per item.
        """
        pending: list[object] = []

        def flush() -> None:
            if pending:
                post(pending.copy())
                pending.clear()

        try:
            if self.lookahead and r.follow is None:
                r.index()
            for _ in range(self.decode_batch):
                if r.stop or r.done:
                    return
                self._decode_step(r, params, options, pending.append, flush)
        finally:
            pending.append(HOP_END)
            flush()

    def _decode_step(
        self,
        r: Run,
        params: SamplingParams,
        options: OutputOptions,
        emit: Callable[[object], None],
        flush: Callable[[], None],
    ) -> None:
        p = len(r.hist)
        step, more, want = r.next_step(params, options)
        tok = step.token_id
        if not (want or more):
            r.done = True
            emit(step)
            return
        r.append(tok)
        if not want:
            emit(step)  # streamed before its pass runs; the cache takes the token once it has run
        g = r.guess
        r.guess = None
        if g is not None and g.tokens[0] == tok and not want:
            # the previous pass already ran this token at this position: its next row is ours
            res, start, ran = g.res, g.start, 0
            if len(g.tokens) > 1:
                r.guess = Guess(res, start, g.tokens[1:])
            if self.runner.static or (len(g.tokens) == 1 and res.end == p + 1):
                r.base, r.base_len = res.kv, p + 1
        else:
            pads = min(self.runner.min_rows - (p + 1 - r.base_len), self._info.max_length - 1 - p)
            guesses = r.guesses(pads) if self.lookahead and pads > 0 else []
            flush()
            res, start = self._advance(r, p + 1, self._readout_layers if want else (), guesses)
            ran = 1
            if guesses:
                r.guess = Guess(res, start, guesses)
        emit(Stored(r.hist[: p + 1], res.kv, ran, hit=ran == 0))
        r.last = res.logits[p - start]
        if want:
            emit(
                Step(
                    token_id=tok,
                    position=p,
                    is_prefill=False,
                    logprob=step.logprob,
                    top_logprobs=step.top_logprobs,
                    readout=self._readout(res, p - start),
                )
            )
        if not more:
            r.done = True

    def _member(self, r: Run, entry: Any, params: SamplingParams, options: OutputOptions) -> Member:
        """A batch member for ``r``: its steps come back through a queue, its KV into ``entry``."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[list[object]] = asyncio.Queue()
        gone = asyncio.Event()

        def post(items: list[object]) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, items)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                r.stop = True

        def on_left(tokens: list[int], kv: KV | None, error: BaseException | None) -> None:
            m.result = (tokens, kv)
            queue.put_nowait([_Left(error)])
            gone.set()

        def left(tokens: list[int], kv: KV | None, error: BaseException | None) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed
                loop.call_soon_threadsafe(on_left, tokens, kv, error)

        concepts = self.concepts

        def readout(rows: dict[int, Any]) -> tuple[float, ...]:
            assert concepts is not None
            return concepts.scores([rows[layer] for layer in concepts.manifest.layers])

        m = Member(
            r,
            params,
            options,
            post,
            left,
            readout=readout if concepts is not None else None,
            lookahead=self.lookahead,
        )
        m.inbox, m.gone = queue, gone
        return m

    async def _decode_batched(self, m: Member) -> AsyncIterator[Step]:
        """Steps of ``m`` as the batch scheduler produces them (after its prefill)."""
        assert self._batch is not None
        batch = self._batch
        queue = m.inbox
        assert queue is not None
        batch.join(m)
        await batch.admitted(m)
        while True:
            for item in await queue.get():
                if isinstance(item, Stats):
                    self.passes += item.passes
                    self.positions_computed += item.positions
                    self.lookahead_hits += item.hits
                elif isinstance(item, _Left):
                    if item.error is not None:
                        raise item.error
                    return
                else:
                    assert isinstance(item, Step)
                    m.taken += 1
                    yield item
            if queue.empty():
                batch.wake()

    def _readout(self, res: PassResult, row: int) -> tuple[float, ...]:
        assert self.concepts is not None
        return self.concepts.scores(
            [res.hidden[layer][row] for layer in self.concepts.manifest.layers]
        )

    async def generate(
        self,
        session_key: str,
        history: Sequence[int],
        params: SamplingParams,
        options: OutputOptions = OutputOptions(),  # noqa: B008
    ) -> AsyncIterator[Step]:
        """Check the request, prefill past the cached prefix, report the wanted prompt
        positions, then decode (batched, or a hop at a time in the worker thread)."""
        hist = [int(t) for t in history]
        want = self._wanted(hist, params, options)
        entry = self.cache.checkout(session_key)
        r: Run | None = None
        member: Member | None = None
        try:
            r = self._run_from_cache(entry, hist, want.first_row)
            if params.max_tokens:
                r.guide = self._masks.start(params.constraint, hist)
            self.cache.truncate(entry, r.base_len, keep_buffer=self.runner.static)
            prompt = await self._prefill(r, entry, options, want)
            for step in _prompt_steps(hist, want, prompt, options):
                yield step
            if not params.max_tokens:
                return
            if self._batch is not None:
                member = self._member(r, entry, params, options)
                async for step in self._decode_batched(member):
                    yield step
                return
            async with contextlib.aclosing(self._decode(r, entry, params, options)) as steps:
                async for step in steps:
                    yield step
        finally:
            await self._finish(entry, r, member)

    def _wanted(
        self, hist: Sequence[int], params: SamplingParams, options: OutputOptions
    ) -> _Wanted:
        """Check a request against the model; the prompt positions it asks to have reported."""
        n = len(hist)
        limit = self._info.max_length
        if n + (1 if params.max_tokens else 0) > limit:
            raise ContextOverflow(f"history of {n} tokens leaves no room in {limit}")
        if params.max_tokens and n == 0:
            raise InvalidParameters(
                "the onnx engine needs at least one history token to generate from"
            )
        if options.readout_ranges and self.concepts is None:
            raise InvalidParameters("the served model has no readout concepts")
        # from the ranges, not by asking about every position: a cached turn on a long history
        # must not cost O(history) Python calls
        want_lp = _positions(options.logprob_ranges, 1, n)
        want_ro = _positions(options.readout_ranges, 0, n)
        # rows that must be recomputed: logits of p-1 score p; hidden states of p give its readout
        first_row = min([n - 1 if params.max_tokens else n, *(p - 1 for p in want_lp), *want_ro])
        return _Wanted(frozenset(want_lp), frozenset(want_ro), first_row)

    def _run_from_cache(self, entry: Any, hist: list[int], first_row: int) -> Run:
        """A run over ``hist`` on the longest cached prefix it may keep (none from ``first_row`` on)."""
        keep = min(entry.length, first_row, common_prefix(entry.tokens, hist))
        static = self.runner.static
        base = entry.kv
        if base is not None and static and self.cache.shared(base):
            # a fork's buffer: write into our own
            base = self.runner.copy(base) if keep > 0 else None
        if base is None or (keep == 0 and not static):
            base = self.runner.empty()
        return Run(hist, len(hist), base, keep)

    async def _prefill(self, r: Run, entry: Any, options: OutputOptions, want: _Wanted) -> _Prompt:
        """Run the history past the cached prefix in passes of up to ``prefill_chunk`` positions,
        storing each pass's KV; returns the wanted positions' logprobs and readouts."""
        hist, n = r.hist, r.n
        got = _Prompt()
        pos = r.base_len
        while pos < n:
            end = min(n, pos + self.prefill_chunk)
            wants_readout = _positions(options.readout_ranges, pos, end)
            layers = self._readout_layers if wants_readout else ()
            # the head runs only on the rows whose logits are used: the chunk's last (the
            # next token's) and those of the prompt logprobs asked for
            need = [p for p in range(pos, end - 1) if p + 1 in want.logprobs]
            first = need[0] if need else end - 1
            res, start = await self._in_worker(self._advance, r, end, layers, (), first)
            self.passes += 1
            self.positions_computed += end - pos
            self.cache.store(entry, hist[:end], res.kv)
            for p in range(pos, end):
                row = p - start
                if p + 1 in want.logprobs:
                    logp = log_softmax(res.row_logits(row))
                    got.logprobs[p + 1] = (
                        float(logp[hist[p + 1]]),
                        top_logprobs(logp, options.logprob_top_k),
                    )
                if layers and p in want.readouts:
                    got.readouts[p] = self._readout(res, row)
            r.last = res.row_logits(end - 1 - start)
            pos = end
        return got

    async def _decode(
        self, r: Run, entry: Any, params: SamplingParams, options: OutputOptions
    ) -> AsyncGenerator[Step, None]:
        """Decode one session in the worker thread, a hop of up to ``decode_batch`` steps at a time.

        Steps and cache updates come back through a queue in order, so the
        caller can stop at any yield and the cache holds only tokens that
        were yielded and run.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[list[object]] = asyncio.Queue()

        def post(items: list[object]) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, items)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                r.stop = True

        while not r.done:
            hop = loop.run_in_executor(self._pool, self._decode_hop, r, params, options, post)
            ended = False
            while not ended:
                for item in await queue.get():
                    if item is HOP_END:
                        ended = True
                    elif isinstance(item, Stored):
                        self.passes += item.passes
                        self.positions_computed += 1
                        self.lookahead_hits += item.hit
                        self.cache.store(entry, item.tokens, item.kv)
                    else:
                        assert isinstance(item, Step)
                        yield item
            await hop  # raises what the worker raised

    async def _finish(self, entry: Any, r: Run | None, member: Member | None) -> None:
        """End a generation: stop its run, store a batch member's KV (up to what the caller
        took), release the cache entry and free a buffer that no pass stored."""
        if r is not None:
            r.stop = True
        if member is not None and self._batch is not None and self._batch.leave(member):
            await member_left(member)  # the scheduler hands the slot's KV back
        if member is not None and member.result is not None:
            tokens, kv = member.result
            if kv is not None:
                # only what the caller took: it may have stopped before the run-ahead
                self.cache.store(entry, tokens[: r.n + member.taken] if r else tokens, kv)
        self.cache.release(entry)
        if r is not None and self.runner.static and not self.cache.holds(r.base):
            self.runner.release(r.base)  # a buffer that no pass stored (the first one failed)


def _prompt_steps(
    hist: Sequence[int], want: _Wanted, got: _Prompt, options: OutputOptions
) -> Iterator[Step]:
    """The prompt's steps to report, in position order, with their logprobs and readouts."""
    first = {0} if options.wants_logprobs(0, False) else set()
    for p in sorted(want.logprobs | want.readouts | first):
        lpv, top = got.logprobs.get(p, (None, ()))
        yield Step(
            token_id=hist[p],
            position=p,
            is_prefill=True,
            logprob=lpv,
            top_logprobs=top,
            readout=got.readouts.get(p),
        )


def _positions(ranges: Sequence[tuple[int, int]], lo: int, hi: int) -> list[int]:
    """The positions in [lo, hi) that the half-open ``ranges`` cover, sorted."""
    got: set[int] = set()
    for a, b in ranges:
        got.update(range(max(a, lo), min(b, hi)))
    return sorted(got)


@dataclass(frozen=True)
class _Wanted:
    """The prompt positions a generation reports, and the first one whose pass must run again."""

    #: positions whose logprob is wanted (scored by the logits of the one before)
    logprobs: frozenset[int]
    #: positions whose readout is wanted (from their own hidden states)
    readouts: frozenset[int]
    first_row: int


@dataclass(eq=False)
class _Prompt:
    """The prompt positions' logprobs (with their top alternatives) and readouts, by position."""

    logprobs: dict[int, tuple[float, tuple[tuple[int, float], ...]]] = field(default_factory=dict)
    readouts: dict[int, tuple[float, ...]] = field(default_factory=dict)


@dataclass(eq=False)
class _Left:
    """A batch member has left the scheduler (with the error that ended it, if any)."""

    error: BaseException | None


async def member_left(m: Member) -> None:
    """Wait until the scheduler has handed ``m``'s KV back to the cache."""
    assert m.gone is not None
    await m.gone.wait()
