"""Loops over a whole session's history hand the event loop back as they go.

Reading a session's events back, folding them into its document, replaying
or auditing them runs Python for every event: 5-20 us each, so 30-40 ms for
a session of 2,000 tokens and four times that for a real model's 8k context.
Run in one go, that stalls every other session served by the process (their
turns, their streams) for as long. Such loops iterate with
:func:`handing_back`, which gives the event loop back every
:data:`HANDBACK_EVERY` items, so other work interleaves; what the loop
computes is unchanged (its input was read before it started).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import TypeVar

__all__ = ["HANDBACK_EVERY", "handing_back"]

T = TypeVar("T")

#: items a history loop handles between two hand-backs (about 1-5 ms of work)
HANDBACK_EVERY = 256


async def handing_back(items: Iterable[T], every: int = HANDBACK_EVERY) -> AsyncIterator[T]:
    """``items`` in order, with the event loop handed back after every ``every`` of them."""
    if every < 1:
        raise ValueError(f"every must be at least 1, got {every}")
    for i, item in enumerate(items, 1):
        yield item
        if i % every == 0:
            await asyncio.sleep(0)
