"""One generate call's decoding state, shared by the loop thread and the thread running passes.

:class:`Run` is where a generation stands in its history (the KV buffer it
extends, the logits of its last position, lookahead guesses); the engine's
single-session hops (:mod:`sessiontape.engines.onnx.engine`) and the batch scheduler
(:mod:`sessiontape.engines.onnx.batch`) both drive it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sessiontape.core.engine.interface import OutputOptions, SamplingParams, Step
from sessiontape.engines.onnx.kvcache import KV
from sessiontape.engines.onnx.runner import PassResult
from sessiontape.engines.sampling import log_softmax, sample, top_logprobs

#: lookahead guesses come from the last this many tokens of the history (building the
#: index is Python work per call; results never depend on it, only the hit rate)
LOOKAHEAD_WINDOW = 2048


@dataclass(eq=False)
class Guess:
    """A pass that ran guessed tokens after the real ones; ``tokens`` are the guesses not yet checked."""

    res: PassResult
    start: int
    tokens: list[int]


@dataclass(eq=False)
class Run:
    """One generate call's place in its history, shared with the worker thread.

    ``base`` holds exactly ``base_len`` real positions (no padding row); the
    next pass runs ``hist[base_len:]`` on it. The loop thread sets ``stop``
    when the caller stops iterating; the worker sets ``done`` at the end.
    """

    hist: list[int]
    n: int
    base: KV
    base_len: int
    last: Any = None
    stop: bool = False
    done: bool = False
    guess: Guess | None = None
    #: what followed each token pair (and each token) most recently in the history
    follow: dict[tuple[int, int], int] | None = None
    follow1: dict[int, int] = field(default_factory=dict)

    def index(self) -> None:
        h = self.hist[-LOOKAHEAD_WINDOW:]
        self.follow = {(h[i - 2], h[i - 1]): h[i] for i in range(2, len(h))}
        self.follow1 = {h[i - 1]: h[i] for i in range(1, len(h))}

    def next_step(self, params: SamplingParams, options: OutputOptions) -> tuple[Step, bool, bool]:
        """Sample the token at the next position from ``last``: the step to report, whether
        the generation goes on after it, and whether its readout is wanted (which needs
        the pass that runs it). Nothing is appended."""
        p = len(self.hist)
        tok, tok_lp = sample(self.last, params, p, self.hist, self.n)
        top = (
            top_logprobs(log_softmax(self.last), options.logprob_top_k)
            if options.logprob_top_k
            else ()
        )
        step = Step(
            token_id=tok,
            position=p,
            is_prefill=False,
            logprob=tok_lp if options.wants_logprobs(p, generated=True) else None,
            top_logprobs=top,
        )
        more = p - self.n + 1 < params.max_tokens and tok not in params.stop_token_ids
        return step, more, options.wants_readout(p)

    def append(self, tok: int) -> None:
        h = self.hist
        if self.follow is not None:
            if len(h) >= 2:
                self.follow[(h[-2], h[-1])] = tok
            if h:
                self.follow1[h[-1]] = tok
        h.append(tok)

    def guesses(self, count: int) -> list[int]:
        """Up to ``count`` next tokens guessed from what followed the same tokens before."""
        out: list[int] = []
        if self.follow is None or not self.hist:
            return out
        a, b = (self.hist[-2] if len(self.hist) >= 2 else -1), self.hist[-1]
        while len(out) < count:
            g = self.follow.get((a, b), self.follow1.get(b))
            if g is None:
                break
            out.append(g)
            a, b = b, g
        return out


@dataclass(eq=False)
class Stored:
    tokens: list[int]
    kv: KV
    passes: int
    hit: bool


HOP_END = object()
