"""The reference engine: deterministic, dependency-light, the test oracle.

Logits at each position are a fixed pseudo-random function of the previous
two tokens and the position (a hashed bigram "model"), so every transport
can be tested without ONNX and any result can be recomputed exactly. It
tokenizes bytes (ids 0-255), with BOS 256, EOS 257 and an image pad 258;
an image becomes a block of ``image_tokens`` tokens (markers included).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sessiontape.core.engine.interface import (
    DEFAULT_OUTPUT,
    Engine,
    EngineInfo,
    OutputOptions,
    ReadoutManifest,
    SamplingParams,
    Step,
    TextCodec,
)
from sessiontape.core.errors import ConfigError, ContextOverflow
from sessiontape.core.settings_framework import load_section, option
from sessiontape.engines.byte_tokenizer import ByteTokenizer
from sessiontape.engines.models.sampling_defaults import SamplingOptions
from sessiontape.engines.sampling import log_softmax, sample, top_logprobs

BOS, EOS, IMAGE_PAD = 256, 257, 258
VOCAB = 259


@dataclass(frozen=True)
class ReferenceOptions(SamplingOptions):
    """``[engine.options]`` of the reference engine (it recommends no sampling itself)."""

    max_length: int = option(4096, "context limit, in tokens", ge=1)
    image_tokens: int | None = option(
        10, "an image's block length, markers included (unset: a text-only engine)", ge=1
    )
    eos_bias: float = option(0.0, "added to EOS's logit (negative: longer generations)")
    step_delay_s: float = option(0.0, "a delay per generated step, for tests and demos", ge=0)


class ReferenceEngine(Engine):
    options_class = ReferenceOptions

    def __init__(self, options: ReferenceOptions | None = None, **kwargs: Any) -> None:
        """``ReferenceEngine(eos_bias=-100.0)``, or from options; ConfigError for bad ones."""
        if options is not None and kwargs:
            raise ConfigError("give the reference engine options or keywords, not both")
        opts = options or load_section(ReferenceOptions, kwargs, "engine.options")
        self._tok = ByteTokenizer(VOCAB)
        self.step_delay_s = opts.step_delay_s
        self.eos_bias = opts.eos_bias
        self._info = EngineInfo(
            name="reference",
            model_id="reference-bigram-v1",
            model_hash=hashlib.sha256(b"reference-bigram-v1").hexdigest(),
            vocab_size=VOCAB,
            max_length=opts.max_length,
            eos_token_ids=(EOS,),
            image_block_tokens=opts.image_tokens,
            image_pad_token_id=IMAGE_PAD,
            readout_manifest=ReadoutManifest(
                concepts=("bytes", "letters"), layers=(0, 1), hidden_size=8
            ),
            provider="python",
            runtime_version="1",
            sampling=opts.chosen(),
        )

    @property
    def info(self) -> EngineInfo:
        return self._info

    def text_codec(self) -> TextCodec:
        return self._tok

    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self._tok.decode(tokens)

    def logits(
        self, history: Sequence[int], position: int
    ) -> np.ndarray[Any, np.dtype[np.float32]]:
        a = history[position - 2] if position >= 2 else BOS
        b = history[position - 1] if position >= 1 else BOS
        seed = int.from_bytes(
            hashlib.blake2b(f"{a},{b}".encode(), digest_size=8).digest(), "little"
        )
        out = np.random.default_rng(seed).standard_normal(VOCAB).astype(np.float32) * np.float32(
            3.0
        )
        out[EOS] += np.float32(self.eos_bias)
        out[IMAGE_PAD] = np.float32(-30.0)
        out[BOS] = np.float32(-30.0)
        return out

    def readout(self, history: Sequence[int], position: int) -> tuple[float, ...]:
        tok = history[position]
        return (float(tok < 256), float(65 <= tok <= 122), float(tok) / VOCAB, float(position % 7))

    async def generate(
        self,
        session_key: str,
        history: Sequence[int],
        params: SamplingParams,
        options: OutputOptions = DEFAULT_OUTPUT,
    ) -> AsyncIterator[Step]:
        hist = list(history)
        n = len(hist)
        if n + (1 if params.max_tokens else 0) > self._info.max_length:
            raise ContextOverflow(
                f"history of {n} tokens leaves no room in {self._info.max_length}"
            )
        for p in _prompt_positions(options, n):
            want_lp = options.wants_logprobs(p, generated=False)
            want_ro = options.wants_readout(p)
            lp = log_softmax(self.logits(hist, p)) if want_lp else None
            yield Step(
                token_id=hist[p],
                position=p,
                is_prefill=True,
                logprob=None if lp is None else float(lp[hist[p]]),
                top_logprobs=() if lp is None else top_logprobs(lp, options.logprob_top_k),
                readout=self.readout(hist, p) if want_ro else None,
            )
        stops = set(params.stop_token_ids)
        for i in range(params.max_tokens):
            if self.step_delay_s:
                await asyncio.sleep(self.step_delay_s)
            else:
                await asyncio.sleep(0)
            p = n + i
            logits = self.logits(hist, p)
            tok, tok_lp = sample(logits, params, p, hist, n)
            hist.append(tok)
            want_ro = options.wants_readout(p)
            yield Step(
                token_id=tok,
                position=p,
                is_prefill=False,
                logprob=tok_lp if options.wants_logprobs(p, generated=True) else None,
                top_logprobs=top_logprobs(log_softmax(logits), options.logprob_top_k),
                readout=self.readout(hist, p) if want_ro else None,
            )
            if tok in stops:
                return

    def cached_length(self, session_key: str) -> int | None:
        return None

    @classmethod
    def recorded_codec(cls, binding: Mapping[str, Any]) -> ByteTokenizer:
        return ByteTokenizer(int(binding.get("vocab_size") or VOCAB))


def _prompt_positions(options: OutputOptions, n: int) -> list[int]:
    """The prompt positions (below ``n``) some range asks about, in order: a turn's work
    follows what was asked, not the length of the session's history."""
    wanted: set[int] = set()
    for a, b in (*options.logprob_ranges, *options.readout_ranges):
        wanted.update(range(max(0, a), min(b, n)))
    return sorted(wanted)
