"""The Engine ABC: what the runtime asks of an inference engine.

Engines live in the top-level ``engines`` package (or any third-party
distribution) and register under the ``sessiontape.engines`` entry-point
group; the runtime finds them by name through :mod:`sessiontape.core.plugins`. The ABC
lives here so ``core`` never imports an engine module.

An engine is stateless from the log's point of view: the log is the truth,
and an engine may keep per-session caches (KV) keyed by ``session_key`` only
as an optimisation. Every ``generate`` call receives the session's full token
history, so an engine that lost its cache (eviction, restart) recomputes it.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol


@dataclass(frozen=True)
class ReadoutManifest:
    """What per-token readouts mean: ``readout`` is ``[len(layers)][len(concepts)]``."""

    concepts: tuple[str, ...]
    layers: tuple[int, ...]
    hidden_size: int
    dtype: str = "float32"


@dataclass(frozen=True)
class ChatFormat:
    """A model's own chat template (Jinja source, rendered as transformers renders it)."""

    template: str
    bos_token: str | None = None
    eos_token: str | None = None


@dataclass(frozen=True)
class ModelSampling:
    """The sampling a served model recommends for requests that name none (its
    ``generation_config.json``, a GGUF's ``general.sampling.*``, a registry entry, or
    the operator's ``[engine.options]``). ``None``: no recommendation, the wire's
    default applies (temperature 1, top_p 1, top_k 0)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    penalty_last_n: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v is not None}


#: the sampling fields a request may leave to the model (:attr:`SamplingParams.from_model`)
MODEL_SAMPLED = ("temperature", "top_p", "top_k", "repetition_penalty", "min_p", "penalty_last_n")
#: the bound of OpenAI's ``frequency_penalty`` and ``presence_penalty``: [-2, 2]
MAX_ADDITIVE_PENALTY = 2.0
#: how many of a generation's last tokens the penalties look back over when nothing
#: says otherwise (llama.cpp's ``repeat_last_n``)
PENALTY_LAST_N = 64


def left_to_model(**fields: object) -> frozenset[str]:
    """The names among ``fields`` (of :data:`MODEL_SAMPLED`) that a request left unset
    (``None``): ``left_to_model(temperature=body.temperature, top_p=None)``."""
    unknown = set(fields) - set(MODEL_SAMPLED)
    if unknown:
        raise ValueError(f"not sampling fields a model recommends: {sorted(unknown)}")
    return frozenset(k for k, v in fields.items() if v is None)


@dataclass(frozen=True)
class EngineInfo:
    name: str
    model_id: str
    model_hash: str
    vocab_size: int
    max_length: int
    eos_token_ids: tuple[int, ...]
    #: pad tokens one image becomes (the whole block, markers included);
    #: ``None`` when the model takes no images.
    image_block_tokens: int | None = None
    image_pad_token_id: int | None = None
    readout_manifest: ReadoutManifest | None = None
    #: the execution provider actually used, e.g. "CPUExecutionProvider".
    provider: str = "python"
    runtime_version: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)
    #: the served model's chat template, when it brings one
    chat: ChatFormat | None = None
    #: where the model came from (recorded in ``session.opened``): ``source_sha256``,
    #: ``tokenizer_sha256``, ``chat_template_sha256``, ``dtype`` for an imported model
    origin: Mapping[str, str] = field(default_factory=dict)
    #: what the served model recommends where a request names no sampling
    sampling: ModelSampling = field(default_factory=ModelSampling)

    def provenance(self) -> dict[str, Any]:
        """The engine binding recorded in every session's ``session.opened`` event."""
        return {
            "engine": self.name,
            "model_id": self.model_id,
            "model_hash": self.model_hash,
            "provider": self.provider,
            "runtime_version": self.runtime_version,
            "vocab_size": self.vocab_size,
            "max_length": self.max_length,
            **self.origin,
        }


#: the largest ``max_tokens`` a request may ask for (engines stop at their max length anyway)
MAX_TOKENS_LIMIT = 2**31


#: The most stop (or end-of-sequence) ids a request may name: a handful is what clients
#: send; the bound keeps a request's checks and its stored record small.
MAX_STOP_IDS = 1024


def check_stop_ids(ids: Sequence[int], name: str) -> None:
    """InvalidParameters when ``ids`` has more than :data:`MAX_STOP_IDS` entries, checked
    before any work on them."""
    if len(ids) > MAX_STOP_IDS:
        from sessiontape.core.errors import InvalidParameters

        raise InvalidParameters(f"{name} of {len(ids):,} ids (at most {MAX_STOP_IDS:,})")


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters, already defaulted (temperature 0 means greedy)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    #: divides a positive score, multiplies a negative one, of every token among the
    #: last ``penalty_last_n`` the generation produced (llama.cpp's and transformers')
    repetition_penalty: float = 1.0
    #: OpenAI's: subtracted from a token's score once per occurrence in that window
    frequency_penalty: float = 0.0
    #: OpenAI's: subtracted from the score of a token that occurs in that window
    presence_penalty: float = 0.0
    #: tokens less probable than ``min_p`` times the most probable one are not drawn
    min_p: float = 0.0
    #: how far back the penalties look: the last this many tokens the generation
    #: produced (never its prompt), 0 none, -1 all of them (docs/models.md, Penalties)
    penalty_last_n: int = PENALTY_LAST_N
    #: fields of :data:`MODEL_SAMPLED` the request left unset: the served model's
    #: recommendation replaces their value when the generation begins
    #: (:meth:`for_model`); never recorded, the resolved values are
    from_model: frozenset[str] = frozenset()

    def for_model(self, model: ModelSampling) -> SamplingParams:
        """These parameters with the fields left to the model set as ``model`` recommends
        (fields it says nothing of keep their value)."""
        if not self.from_model:
            return self
        chosen = {k: getattr(model, k) for k in self.from_model if k in MODEL_SAMPLED}
        chosen = {k: v for k, v in chosen.items() if v is not None}
        return replace(self, from_model=frozenset(), **chosen)

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes a score."""
        return self.penalty_last_n != 0 and (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def to_json(self) -> dict[str, Any]:
        """The recorded form; the penalties and ``min_p`` only where they act, so a
        generation without them records what it always did."""
        out: dict[str, Any] = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            # seeds may exceed 2**53: keep them exact as strings in JSON
            "seed": None if self.seed is None else str(self.seed),
            "stop_token_ids": list(self.stop_token_ids),
        }
        if self.penalized:
            out["repetition_penalty"] = self.repetition_penalty
            out["frequency_penalty"] = self.frequency_penalty
            out["presence_penalty"] = self.presence_penalty
            out["penalty_last_n"] = self.penalty_last_n
        if self.min_p:
            out["min_p"] = self.min_p
        return out

    def check(self) -> None:
        """Raise InvalidParameters unless every field is in its range.

        temperature finite and >= 0, top_p in (0, 1], top_k >= 0,
        0 <= max_tokens <= 2**31, seed in [0, 2**64) when given, stop ids >= 0,
        repetition_penalty finite and > 0, frequency and presence penalties in [-2, 2],
        min_p in [0, 1], penalty_last_n >= -1.
        """
        from sessiontape.core.errors import InvalidParameters

        def integer(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        def number(value: Any) -> bool:
            return (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and math.isfinite(value)
            )

        if not number(self.temperature) or self.temperature < 0:
            raise InvalidParameters(
                f"temperature must be a finite number >= 0, got {self.temperature!r}"
            )
        if not number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidParameters(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not integer(self.top_k) or self.top_k < 0:
            raise InvalidParameters(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not integer(self.max_tokens) or not 0 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise InvalidParameters(
                f"max_tokens must be an integer in [0, 2**31], got {self.max_tokens!r}"
            )
        if self.seed is not None and (not integer(self.seed) or not 0 <= self.seed < 2**64):
            raise InvalidParameters(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        check_stop_ids(self.stop_token_ids, "stop_token_ids")
        if any(not integer(t) or not 0 <= t < 2**63 for t in self.stop_token_ids):
            raise InvalidParameters("stop_token_ids must be integers >= 0")
        if not number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidParameters(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not number(value) or abs(value) > MAX_ADDITIVE_PENALTY:
                raise InvalidParameters(f"{name} must be a number in [-2, 2], got {value!r}")
        if not number(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidParameters(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if not integer(self.penalty_last_n) or not -1 <= self.penalty_last_n < 2**31:
            raise InvalidParameters(
                f"penalty_last_n must be an integer >= -1, got {self.penalty_last_n!r}"
            )

    @classmethod
    def from_json(cls, params: Mapping[str, Any]) -> SamplingParams:
        """From the JSON form :meth:`to_json` writes (a ``generation.started``'s ``params``)."""
        seed = params.get("seed")
        return cls(
            max_tokens=int(params.get("max_tokens", 16)),
            temperature=float(params.get("temperature", 1.0)),
            top_p=float(params.get("top_p", 1.0)),
            top_k=int(params.get("top_k", 0)),
            seed=None if seed is None else int(seed),
            stop_token_ids=tuple(int(t) for t in params.get("stop_token_ids", ())),
            repetition_penalty=float(params.get("repetition_penalty", 1.0)),
            frequency_penalty=float(params.get("frequency_penalty", 0.0)),
            presence_penalty=float(params.get("presence_penalty", 0.0)),
            min_p=float(params.get("min_p", 0.0)),
            penalty_last_n=int(params.get("penalty_last_n", PENALTY_LAST_N)),
        )


@dataclass(frozen=True)
class OutputOptions:
    """What to report per position. Ranges are half-open absolute positions."""

    logprob_top_k: int = 0
    #: positions (prompt or generated) whose logprobs are wanted
    logprob_ranges: tuple[tuple[int, int], ...] = ()
    #: positions whose readouts are wanted
    readout_ranges: tuple[tuple[int, int], ...] = ()
    #: report logprobs for every generated token regardless of ranges
    generated_logprobs: bool = True

    def wants_logprobs(self, position: int, generated: bool) -> bool:
        if generated and self.generated_logprobs:
            return True
        return any(a <= position < b for a, b in self.logprob_ranges)

    def wants_readout(self, position: int) -> bool:
        return any(a <= position < b for a, b in self.readout_ranges)


DEFAULT_OUTPUT = OutputOptions()


@dataclass(frozen=True)
class Step:
    """One position the engine reports: a scored prompt token or a generated one."""

    token_id: int
    position: int
    is_prefill: bool
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    readout: tuple[float, ...] | None = None


class TextCodec(Protocol):
    """An engine's text <-> token mapping as a picklable object (:meth:`Engine.text_codec`)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class Engine(ABC):
    """An inference engine. Implementations must be deterministic for a seed."""

    @property
    @abstractmethod
    def info(self) -> EngineInfo:
        """Static facts about the served model."""

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Text to token ids (no special tokens added)."""

    @abstractmethod
    def detokenize(self, tokens: Sequence[int]) -> str:
        """Token ids to text; ids that are not text render as nothing."""

    @abstractmethod
    def generate(
        self,
        session_key: str,
        history: Sequence[int],
        params: SamplingParams,
        options: OutputOptions = DEFAULT_OUTPUT,
    ) -> AsyncIterator[Step]:
        """Prefill ``history`` and decode up to ``params.max_tokens`` tokens.

        Yields first the prompt positions that ``options`` asks to be scored
        (``is_prefill=True``), then each generated token in order. Stops after
        an EOS/stop token (which is yielded) or ``max_tokens``. The caller may
        stop iterating at any time (cancellation); the engine must then keep
        its cache consistent with the tokens it actually yielded.

        The result must depend only on ``history``, ``params`` and the model:
        never on how the history was built up or on cache state (INV-3).

        Raises :class:`sessiontape.core.errors.ContextOverflow` when the history plus
        ``max_tokens`` exceeds the model, :class:`sessiontape.core.errors.EngineError`
        on engine failure.
        """

    def failure(self) -> str | None:
        """Why the engine can serve nothing more (a worker process that died), or None.
        ``/healthz`` reports it."""
        return None

    @classmethod
    def recorded_codec(cls, binding: Mapping[str, Any]) -> TextCodec | None:
        """The text codec of a session this engine served (``binding``: the engine entry
        its ``session.opened`` recorded), found without loading a model, so that the
        terminal commands show the session's text; None when it is not at hand here."""
        return None

    def text_codec(self) -> TextCodec | None:
        """The engine's :meth:`tokenize`/:meth:`detokenize` as a picklable object, when it has
        one: an engine served from another process (``core/engine/worker.py``) runs it on the
        server's side, where transports call it per token. None: ask the engine each time."""
        return None

    def fork(self, parent_key: str, child_key: str, at_position: int) -> None:  # noqa: B027
        """Hint: ``child_key`` starts as the first ``at_position`` tokens of ``parent_key``."""

    def forget(self, session_key: str) -> None:  # noqa: B027
        """Hint: drop any cache for ``session_key`` (closed, expired)."""

    def rewind(self, session_key: str, length: int) -> None:  # noqa: B027
        """Trim any cache for ``session_key`` to its first ``length`` positions.

        The runtime pulls steps ahead of committing them; when a generation
        stops early it drops the steps the log never got and calls this with
        the committed history length, so the cache never holds a token the
        log does not.
        """

    def kv_live_bytes(self, session_key: str) -> int:
        """Bytes of cache held for ``session_key`` now (0 when none)."""
        return 0

    def kv_total_bytes(self) -> int:
        """Bytes held by all of the engine's caches (shared prefixes counted once)."""
        return 0

    @property
    def batches(self) -> bool:
        """Whether the engine puts the steps of many generations into shared passes itself.

        The runtime then lets every generation pull steps at once instead of
        taking turns through its priority gate (turns would leave all but one
        session out of each pass).
        """
        return False

    def scheduler_stats(self) -> Mapping[str, float]:
        """A batching engine's scheduler now: ``slots``, ``slots_in_use``, ``queue`` (waiting
        for a slot), ``pass_occupancy``, ``passes``; empty for an engine that does not batch."""
        return {}

    def cached_length(self, session_key: str) -> int | None:
        """Length of the cached prefix for ``session_key`` (INV-1 checks), if any."""
        return None

    def image_block_length(self, image: bytes, mime: str) -> int:
        """How many pad tokens ``image`` becomes; raises InvalidImage when unsupported."""
        from sessiontape.core.errors import InvalidImage

        n = self.info.image_block_tokens
        if n is None:
            raise InvalidImage(f"engine {self.info.name!r} takes no images")
        return n

    async def aclose(self) -> None:  # noqa: B027
        """Release resources."""
