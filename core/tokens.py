"""Token-history rules shared by every transport: offsets, append-only,
vocabulary range, image pad runs, truncation."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sessiontape.core.bodies import GenerationToken, TokensAppended, TokensTruncated, body_as
from sessiontape.core.errors import (
    AppendOnlyViolation,
    ContextOverflow,
    ImageBlockSplit,
    InvalidImage,
    InvalidRange,
    OffsetMismatch,
    TokenOutOfVocabulary,
)
from sessiontape.core.session.state import SessionState


@dataclass(frozen=True)
class ImageIn:
    """An image whose pad-token block is ``[start, end)`` of the history after the append."""

    data: bytes
    mime: str
    start: int
    end: int


def check_vocab(tokens: Sequence[int], vocab_size: int) -> None:
    for i, t in enumerate(tokens):
        if not 0 <= t < vocab_size:
            raise TokenOutOfVocabulary(
                f"token {t} at index {i} is outside the vocabulary [0, {vocab_size})"
            )


def check_ranges(ranges: Sequence[tuple[int, int]], limit: int, what: str) -> None:
    for a, b in ranges:
        if a >= b or b > limit:
            raise InvalidRange(f"{what} range [{a}, {b}) is empty or beyond position {limit}")


def rewind_point(state: SessionState, offset: int | None, truncating: bool) -> int | None:
    """Where the history must be cut before appending, or None for no cut.

    Salience's rule: ``offset`` must equal the length, or be strictly less
    with ``truncating``. ``offset=None`` means "append at the end" (Kakeya).
    """
    n = state.length
    if offset is not None and offset < 0:
        raise OffsetMismatch(f"offset {offset} is negative")
    if offset is None or offset == n:
        return None
    if offset < n and truncating:
        if state.mode == "append_only":
            raise AppendOnlyViolation(f"session {state.session_id} is append-only")
        for im in state.images:
            if im.start < offset < im.end:
                raise ImageBlockSplit(
                    f"offset {offset} falls inside the image block [{im.start}, {im.end})"
                )
        return offset
    raise OffsetMismatch(
        f"offset {offset} does not match the session length {n}"
        + ("" if truncating else " (set truncating to rewind)")
    )


def check_images(
    images: Sequence[ImageIn],
    base: int,
    new_length: int,
    block_len: int | None,
    tokens: Sequence[int],
    pad_token: int | None,
) -> None:
    """Each image must cover a run of pad tokens inside the appended span."""
    spans: list[tuple[int, int]] = []
    for im in images:
        if block_len is None:
            raise InvalidImage("the served engine takes no images")
        if not base <= im.start < im.end <= new_length:
            raise InvalidImage(
                f"image block [{im.start}, {im.end}) is not inside the appended tokens [{base}, {new_length})"
            )
        if im.end - im.start != block_len:
            raise InvalidImage(
                f"image block [{im.start}, {im.end}) has {im.end - im.start} tokens; the engine expands an image to {block_len}"
            )
        if pad_token is not None:
            inner = tokens[im.start - base + 1 : im.end - base - 1]
            if any(t != pad_token for t in inner):
                raise InvalidImage(
                    f"image block [{im.start}, {im.end}) is not a run of pad token {pad_token}"
                )
        if not im.data:
            raise InvalidImage("image without bytes")
        spans.append((im.start, im.end))
    spans.sort()
    for (_, e1), (s2, _) in itertools.pairwise(spans):
        if s2 < e1:
            raise InvalidImage("image blocks overlap")


def check_fork_point(state: SessionState, at: int) -> None:
    if not 0 <= at <= state.length:
        raise InvalidRange(f"fork position {at} is outside [0, {state.length}]")
    for im in state.images:
        if im.start < at < im.end:
            raise ImageBlockSplit(
                f"fork position {at} falls inside the image block [{im.start}, {im.end})"
            )


def check_length(new_length: int, max_length: int) -> None:
    if new_length > max_length:
        raise ContextOverflow(f"history of {new_length} tokens exceeds the model's {max_length}")


def sink_window_keep(length: int, sink: int, window: int) -> list[list[int]] | None:
    """Kakeya sink+window: keep the first ``sink`` and the last ``window`` tokens."""
    if length <= sink + window:
        return None
    return [[0, sink], [length - window, length]]


def length_after(length: int, body_type: str, body: Mapping[str, Any]) -> int:
    """History length after an event (for the sessions index): ``body`` is the
    event's body, ``body_type`` its type."""
    from sessiontape.core.events import T

    if body_type == T.TOKENS_APPENDED:
        return length + len(body_as(body_type, body, TokensAppended)["tokens"])
    if body_type == T.TOKENS_TRUNCATED:
        return sum(end - start for start, end in body_as(body_type, body, TokensTruncated)["keep"])
    if body_type == T.GENERATION_TOKEN and not body_as(body_type, body, GenerationToken).get(
        "is_prefill"
    ):
        return length + 1
    return length


def fold_tokens(history: list[int], body_type: str, body: Mapping[str, Any]) -> None:
    """Fold an event not committed yet into ``history`` (in place), as the fold will
    (the engine starts on it while the event waits to commit with the first run)."""
    from sessiontape.core.events import T

    if body_type == T.TOKENS_APPENDED:
        history.extend(int(t) for t in body_as(body_type, body, TokensAppended)["tokens"])
    elif body_type == T.TOKENS_TRUNCATED:
        keep = body_as(body_type, body, TokensTruncated)["keep"]
        history[:] = [t for start, end in keep for t in history[int(start) : int(end)]]
