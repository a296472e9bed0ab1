"""D4 (DDIP-001) messages: parsing, validation, cost rules and result bodies.

Pure functions over JSON values: no relay, no runtime, no nostr-sdk. The
worker (:mod:`sessiontape.transports.nostr.worker`) calls these and turns what they raise
(:class:`sessiontape.core.errors.InvalidParameters`) into a D4 ``err`` through
:mod:`sessiontape.transports.nostr.errors`.

A call's ``content`` is parsed with :func:`json.loads`, which keeps JSON
integers exact (a ``seed`` above 2**53 survives); nothing here converts an
integer field through ``float``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sessiontape.core.engine.interface import SamplingParams, left_to_model
from sessiontape.core.errors import InvalidParameters, InvalidValue
from sessiontape.core.events import check_body

VERSION = "0.1.0"
_VERSION_RE = re.compile(r"^0\.1\.\d+$")
_HEX64_RE = re.compile(r"^[0-9a-f]{64}$")

#: the "negotiate price" function id used in the DDIP's own sample
SAMPLE_NEGOTIATE_FUNCTION_ID = "321ddfdaba3a2637e79c9b2f7ec8ec2d9ce6cc0983c7de0c621c0c407a6daab7"

#: seeds are 64-bit on every engine this project ships
MAX_SEED = 2**64 - 1

CALL = "call"
FEEDBACK = "feedback"
RESULT = "result"


@dataclass(frozen=True)
class GenArgs:
    """The sampling arguments of a call (the seed's llama-cpp-style ``args``)."""

    prompt: str | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    max_tokens: int | None
    #: the sampling arguments the call left out (or null): the served model's recommendation
    from_model: frozenset[str] = frozenset()
    #: llama-cpp's ``repeat_penalty`` (1: none)
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0

    def sampling(self, max_tokens: int) -> SamplingParams:
        """These arguments as the generation's parameters, for ``max_tokens`` tokens."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            min_p=self.min_p,
            from_model=self.from_model,
        )


@dataclass(frozen=True)
class Call:
    max_iteration_cost: int
    max_total_cost: int
    results: int
    version: str
    args: GenArgs


@dataclass(frozen=True)
class Feedback:
    score: int
    version: str


def parse_object(content: str) -> dict[str, Any]:
    """An event's ``content`` as a JSON object, or InvalidParameters."""
    try:
        obj = json.loads(content)
    except (ValueError, RecursionError) as exc:
        raise InvalidParameters(f"content is not JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise InvalidParameters("content must be a JSON object")
    try:
        # strict like every wire: no NaN/Infinity, 64-bit integers, no lone surrogates ("\ud800")
        check_body(obj)
    except InvalidValue as exc:
        raise InvalidParameters(f"content: {exc.message}") from None
    return obj


def classify(obj: Mapping[str, Any]) -> str:
    """What a kind-1 event that mentions a function is: a call, feedback, or someone's result."""
    if "score" in obj and "args" not in obj:
        return FEEDBACK
    if (
        "args" not in obj
        and "max_total_cost" not in obj
        and ("result" in obj or "iteration_cost" in obj)
    ):
        return RESULT
    return CALL


def e_refs(tags: Sequence[Sequence[str]]) -> list[str]:
    """The event ids an event's ``e`` tags reference, in tag order (malformed ones skipped)."""
    out: list[str] = []
    for tag in tags:
        if len(tag) >= 2 and tag[0] == "e":
            ref = str(tag[1]).lower()
            if _HEX64_RE.match(ref) and ref not in out:
                out.append(ref)
    return out


def _positive_int(obj: Mapping[str, Any], key: str) -> int:
    value = obj.get(key)
    # bool is an int in Python; a JSON true is not a price
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidParameters(f"{key} must be a positive integer, got {value!r}")
    return value


def check_version(obj: Mapping[str, Any]) -> str:
    version = obj.get("version")
    if not isinstance(version, str) or not _VERSION_RE.match(version):
        raise InvalidParameters(f"version must be 0.1.x, got {version!r}")
    return version


def _number(
    args: Mapping[str, Any],
    key: str,
    default: float,
    lo: float,
    hi: float,
    *,
    lo_open: bool = False,
) -> float:
    value = args.get(key)
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise InvalidParameters(f"args.{key} must be a number, got {value!r}")
    x = float(value)
    if x != x or x > hi or x < lo or (lo_open and x == lo):
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise InvalidParameters(f"args.{key} must be in {bound}, got {value!r}")
    return x


def _int_or_none(args: Mapping[str, Any], key: str, lo: int, hi: int) -> int | None:
    value = args.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise InvalidParameters(f"args.{key} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def parse_args(args: Mapping[str, Any]) -> GenArgs:
    """Sampling arguments; fields this worker does not use (tfs_z, mirostat, ...) are ignored."""
    prompt = args.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise InvalidParameters("args.prompt must be a string")
    stop = args.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(s for s in stop if s)
    else:
        raise InvalidParameters("args.stop must be a string or a list of strings")
    return GenArgs(
        prompt=prompt,
        temperature=_number(args, "temperature", 1.0, 0.0, 100.0),
        top_p=_number(args, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=_int_or_none(args, "top_k", 0, 1 << 31) or 0,
        seed=_int_or_none(args, "seed", 0, MAX_SEED),
        stop=stops,
        max_tokens=_int_or_none(args, "max_tokens", 1, 1 << 31),
        from_model=left_to_model(
            temperature=args.get("temperature"),
            top_p=args.get("top_p"),
            top_k=args.get("top_k"),
            repetition_penalty=args.get("repeat_penalty"),
            min_p=args.get("min_p"),
            penalty_last_n=None,
        ),
        repetition_penalty=_number(args, "repeat_penalty", 1.0, 0.0, 1e6, lo_open=True),
        frequency_penalty=_number(args, "frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=_number(args, "presence_penalty", 0.0, -2.0, 2.0),
        min_p=_number(args, "min_p", 0.0, 0.0, 1.0),
    )


def parse_call(obj: Mapping[str, Any]) -> Call:
    """Validate a call's parameters (DDIP-001 "Function parameters")."""
    max_iteration_cost = _positive_int(obj, "max_iteration_cost")
    max_total_cost = _positive_int(obj, "max_total_cost")
    results = obj.get("results", 1)
    if not isinstance(results, int) or isinstance(results, bool) or results <= 0:
        raise InvalidParameters(f"results must be a positive integer, got {results!r}")
    version = check_version(obj)
    args = obj.get("args")
    if not isinstance(args, dict):
        raise InvalidParameters("args must be a JSON object")
    return Call(max_iteration_cost, max_total_cost, results, version, parse_args(args))


def parse_feedback(obj: Mapping[str, Any]) -> Feedback:
    score = obj.get("score")
    if not isinstance(score, int) or isinstance(score, bool) or not 0 <= score <= 9:
        raise InvalidParameters(f"score must be an integer from 0 to 9, got {score!r}")
    return Feedback(score, check_version(obj))


# -- cost rules ---------------------------------------------------------------


def affordable(price_msat: int, budget_msat: int) -> int | None:
    """Iterations a budget pays for at ``price_msat`` each (None: free, no limit)."""
    if price_msat <= 0:
        return None
    return max(0, budget_msat // price_msat)


def needs_negotiation(price_msat: int, call: Call) -> bool:
    """True when the worker cannot run even one iteration within the client's caps."""
    return price_msat > call.max_iteration_cost or (
        price_msat > 0 and call.max_total_cost < price_msat
    )


def plan_tokens(price_msat: int, budget_msat: int, wanted: int) -> tuple[int, bool]:
    """How many tokens to generate and whether the budget (not ``wanted``) is the limit."""
    can = affordable(price_msat, budget_msat)
    if can is None or can >= wanted:
        return wanted, False
    return can, True


# -- bodies the worker sends --------------------------------------------------


def completion(
    *,
    completion_id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str | None,
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    """An OpenAI-style ``chat.completion`` as in the DDIP's sample response."""
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason,
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def result_content(
    *,
    result: Mapping[str, Any] | None,
    iteration_cost: int,
    total_cost: int,
    more_results: bool,
    partial: bool = False,
    err: Mapping[str, Any] | None = None,
) -> str:
    """A result event's ``content``: ``result`` and ``err`` are serialized JSON strings.

    ``partial`` (an extension field) marks an intermediate streamed result:
    more events follow for the same call without further funding.
    """
    content: dict[str, Any] = {
        "result": None if result is None else json.dumps(result, separators=(",", ":")),
        "iteration_cost": iteration_cost,
        "total_cost": total_cost,
        "more_results": more_results,
        "version": VERSION,
    }
    if partial:
        content["partial"] = True
    if err is not None:
        content["err"] = json.dumps(dict(err), separators=(",", ":"))
    return json.dumps(content, separators=(",", ":"))


def negotiation_content(*, iteration_cost: int, total_cost: int) -> str:
    return json.dumps(
        {
            "result": None,
            "iteration_cost": iteration_cost,
            "total_cost": total_cost,
            "more_results": False,
            "version": VERSION,
        },
        separators=(",", ":"),
    )


def function_content(
    *, name: str, description: str, model_id: str, engine: str, price_msat: int
) -> str:
    """A function ("contract") event's content, DDIP-002 style."""
    return json.dumps(
        {
            "name": name,
            "description": description,
            "model": model_id,
            "engine": engine,
            "price_msat": price_msat,
            "version": VERSION,
        },
        separators=(",", ":"),
    )
