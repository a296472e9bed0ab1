"""Constrained decoding: a generation's :class:`~sessiontape.core.constraint.Constraint`
as a token mask, from llguidance, over the engine's own vocabulary.

:class:`TokenMasks` holds llguidance's view of one engine's tokenizer (built once: a
49k-token vocabulary takes about a second). :meth:`TokenMasks.start` gives a
:class:`Guide` per generation: a matcher fed the history since the constraint's start,
which says before each token which ids the grammar allows (:meth:`Guide.allowed`) and
takes each sampled one (:meth:`Guide.advance`). Sampling draws among the allowed ids
only (:func:`sessiontape.engines.sampling.sample`), so a constrained generation is as
deterministic as any other: the mask depends only on the tokens since the start.

Once the grammar is complete it allows only the end-of-sequence ids, so the
generation ends with EOS; one cut by ``max_tokens`` before that ends with ``length``.

The mask of the next position depends only on the tokens taken, so :meth:`Guide.advance`
starts computing it at once on the engine's mask thread (llguidance releases the GIL while
it computes), while the engine runs the model's pass for the token just taken; the next
:meth:`Guide.allowed` only waits for what is left of it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from sessiontape.core.constraint import Constraint
from sessiontape.core.errors import EngineError, InvalidConstraint

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

Ids = npt.NDArray[np.intp]


class _ByteVocabulary:
    """A byte vocabulary (ids 0-255 are the bytes, the rest special) as llguidance's
    ``TokenizerWrapper`` reads a tokenizer: its tokens' bytes and an encoder."""

    def __init__(self, vocab_size: int, eos: Sequence[int]) -> None:
        self.eos_token_id = eos[0]
        self.bos_token_id = None
        self.tokens = [bytes([i]) for i in range(256)] + [
            f"<|special_{i}|>".encode() for i in range(256, vocab_size)
        ]
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def byte_tokenizer(vocab_size: int, eos: Sequence[int]) -> LLTokenizer:
    """llguidance's tokenizer for a byte vocabulary (the reference engine's, the demo's)."""
    from llguidance import LLTokenizer, TokenizerWrapper

    wrapper = TokenizerWrapper(_ByteVocabulary(vocab_size, eos))
    return LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=list(eos))


def json_tokenizer(tokenizer_json: str, vocab_size: int, eos: Sequence[int]) -> LLTokenizer:
    """llguidance's tokenizer for a Hugging Face ``tokenizer.json`` text."""
    from llguidance import LLTokenizer

    return LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos))


class TokenMasks:
    """One engine's source of guides: llguidance's tokenizer, made on first use."""

    def __init__(self, make: Callable[[], LLTokenizer]) -> None:
        self._make = make
        self._tokenizer: LLTokenizer | None = None
        self._lock = threading.Lock()
        self._thread: ThreadPoolExecutor | None = None

    def _mask_thread(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._thread is None:
                workers = min(4, os.cpu_count() or 1)
                self._thread = ThreadPoolExecutor(workers, thread_name_prefix="token-masks")
            return self._thread

    @property
    def tokenizer(self) -> LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._make()
            return self._tokenizer

    def start(self, constraint: Constraint | None, history: Sequence[int]) -> Guide | None:
        """The guide of a generation over ``history`` (None without a constraint): its
        matcher fed ``history[start:]``. InvalidConstraint when the grammar is refused or
        the history since ``start`` does not match it."""
        if constraint is None:
            return None
        start = len(history) if constraint.start is None else constraint.start
        if start > len(history):
            raise InvalidConstraint(
                f"the constraint starts at {start}, past the history's {len(history)} tokens"
            )
        prefix = [int(t) for t in history[start:]]
        return Guide(self.tokenizer, constraint, prefix, self._mask_thread())


class Guide:
    """One generation's matcher and mask buffer (see the module docstring)."""

    def __init__(
        self,
        tokenizer: LLTokenizer,
        constraint: Constraint,
        prefix: list[int],
        thread: ThreadPoolExecutor | None = None,
    ) -> None:
        from llguidance import LLMatcher

        self._vocab = int(tokenizer.vocab_size)
        self._matcher: LLMatcher = LLMatcher(tokenizer, constraint.grammar, log_level=0)
        if self._matcher.is_error():
            raise InvalidConstraint(
                f"bad {constraint.kind} constraint: {self._matcher.get_error()}"
            )
        if prefix and not self._matcher.consume_tokens(prefix):
            raise InvalidConstraint(
                f"the {len(prefix)} tokens since the constraint's start do not match it"
            )
        self._mask: npt.NDArray[np.int32] = np.zeros((self._vocab + 31) // 32, np.int32)
        self._eos = frozenset(int(t) for t in tokenizer.eos_tokens)
        self._thread = thread
        self._next: Future[None] | None = None
        self.finished = False
        """the grammar took an end-of-sequence id: nothing may follow"""
        self._start_mask()

    def _compute(self) -> None:
        m = self._mask
        self._matcher.unsafe_compute_mask_ptr(m.ctypes.data, m.nbytes)

    def _start_mask(self) -> None:
        """Compute the next mask, on the mask thread when there is one."""
        if self._thread is None:
            self._compute()
        else:
            self._next = self._thread.submit(self._compute)

    def allowed(self) -> Ids:
        """The ids the grammar allows next, in increasing order (never empty)."""
        if self._next is not None:
            self._next.result()
            self._next = None
        bits = np.unpackbits(self._mask.view(np.uint8), bitorder="little")[: self._vocab]
        ids: Ids = np.flatnonzero(bits)
        if ids.shape[0] == 0:
            raise EngineError(f"the constraint allows no token: {self._matcher.get_error()}")
        return ids

    def advance(self, token: int) -> None:
        """Take the sampled ``token`` (one :meth:`allowed` offered)."""
        if not self._matcher.consume_token(int(token)):
            raise EngineError(f"the constraint refused token {token}: {self._matcher.get_error()}")
        self.finished = int(token) in self._eos
        if not self.finished:
            self._start_mask()


def masked(logits: Any, allowed: Ids) -> Any:
    """``logits`` with every id but ``allowed`` at -inf (what top-logprobs report from)."""
    out = np.full_like(logits, -np.inf)
    out[allowed] = logits[allowed]
    return out
