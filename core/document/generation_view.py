"""A generation's entry in the session document (``/generations/N``), from its events.

The document builder (:mod:`sessiontape.core.document.fold`) makes every
entry with these functions as it folds the log; :func:`generation_view` makes
the same entry from the generation's own events alone, for an answer that
needs only that (the HTTP API's ``mode: "json"`` generate): no read or fold of
the session's history, whatever its length.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from sessiontape.core.bodies import (
    GenerationFinished,
    GenerationStarted,
    GenerationToken,
    body,
    generation_id_of,
)
from sessiontape.core.document.schema import params_view
from sessiontape.core.document.text import Detokenize, TextRun
from sessiontape.core.events import Event, T

_TIMING = ("prompt_tokens", "completion_tokens", "prefill_s", "ttft_s", "total_s")


def generation_entry(b: GenerationStarted, started_at: float, *, with_text: bool) -> dict[str, Any]:
    """A running generation's entry, as ``generation.started`` makes it."""
    return {
        "id": str(b["generation_id"]),
        "status": "running",
        "params": params_view(b.get("params", {})),
        "options": dict(b.get("options", {})),
        "prompt_length": b.get("prompt_length"),
        "priority": b.get("priority", 0),
        "action_id": b.get("action_id"),
        "started_at": started_at,
        "finished_at": None,
        "finish_reason": None,
        "text": "" if with_text else None,
        "tokens": [],
        "prefill": [],
        "timing": None,
    }


@functools.lru_cache(maxsize=1 << 16)
def _token_text(detokenize: Detokenize, token: int) -> str:
    """One token's own text, decoded once a process: every entry shows its token's (a
    tokenizer's decode is a pure function of the ids; an engine's bound ``detokenize``
    is equal, and hashes equal, each time it is taken)."""
    return detokenize([token])


def token_entry(b: GenerationToken, at: float, detokenize: Detokenize | None) -> dict[str, Any]:
    """A ``generation.token``'s entry in ``tokens`` (generated) or ``prefill`` (scored)."""

    def text(token: int) -> str | None:
        return None if detokenize is None else _token_text(detokenize, token)

    tok = int(b["token"])
    return {
        "id": tok,
        "position": int(b["position"]),
        "text": text(tok),
        "logprob": b.get("logprob"),
        "top": [{"id": int(i), "text": text(int(i)), "logprob": lp} for i, lp in b.get("top", ())],
        "readout": b.get("readout"),
        "t": b.get("t"),
        "at": at,
    }


def finished_fields(b: GenerationFinished, finished_at: float) -> dict[str, Any]:
    """What ``generation.finished`` sets in the entry."""
    return {
        "status": "finished",
        "finish_reason": b.get("finish_reason"),
        "finished_at": finished_at,
        "timing": {k: b.get(k) for k in _TIMING},
    }


def generation_view(
    detokenize: Detokenize | None, events: Sequence[Event], generation_id: str
) -> dict[str, Any] | None:
    """The document's entry for ``generation_id`` from its own events (its
    ``generation.started`` first); None when they do not include its start."""
    entry: dict[str, Any] | None = None
    run = TextRun(detokenize) if detokenize is not None else None
    for e in events:
        if generation_id_of(e) != generation_id:
            continue
        if e.type == T.GENERATION_STARTED:
            entry = generation_entry(
                body(e, GenerationStarted), e.recorded_at, with_text=run is not None
            )
        elif entry is None:
            continue
        elif e.type == T.GENERATION_TOKEN:
            b = body(e, GenerationToken)
            tok = token_entry(b, e.recorded_at, detokenize)
            if b.get("is_prefill"):
                entry["prefill"].append(tok)
                continue
            entry["tokens"].append(tok)
            if run is not None:
                entry["text"] += run.push([tok["id"]])
        elif e.type == T.GENERATION_FINISHED:
            if run is not None:
                entry["text"] += run.flush()
            entry.update(finished_fields(body(e, GenerationFinished), e.recorded_at))
    return entry
