"""Events as tests append them to a log."""

from __future__ import annotations

from sessiontape.core.events import NewEvent, T


def opened(**extra: object) -> NewEvent:
    return NewEvent(
        T.SESSION_OPENED,
        {"protocol": "test", "engine": {"engine": "x", "vocab_size": 300}, **extra},
    )


def appended(start: int, toks: list[int]) -> NewEvent:
    return NewEvent(T.TOKENS_APPENDED, {"start": start, "tokens": toks})
