"""An append's events: the request's tokens and images checked against the session and
the engine, and the events that record them (nothing is written here).

The runtime's ``append_tokens`` and a generation's first append
(:mod:`sessiontape.core.generation.lifecycle`) both build their events here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from sessiontape.core.bodies import tokens_truncated
from sessiontape.core.engine.interface import Engine
from sessiontape.core.events import NewEvent, T
from sessiontape.core.session.state import SessionState
from sessiontape.core.tokens import (
    ImageIn,
    check_images,
    check_length,
    check_vocab,
    rewind_point,
)


def image_events(images: Sequence[ImageIn]) -> tuple[list[NewEvent], list[tuple[str, int]]]:
    """``image.attached`` per image (its bytes stored with it), and each image's
    (sha256, size)."""
    notes, shas = [], []
    for im in images:
        sha = hashlib.sha256(im.data).hexdigest()
        shas.append((sha, len(im.data)))
        notes.append(
            NewEvent(
                T.IMAGE_ATTACHED,
                {"sha256": sha, "mime": im.mime, "size": len(im.data)},
                im.data,
            )
        )
    return notes, shas


def append_events(
    engine: Engine,
    st: SessionState,
    tokens: Sequence[int],
    offset: int | None,
    truncating: bool,
    images: Sequence[ImageIn],
    image_blobs: list[tuple[str, int]],
) -> list[NewEvent]:
    """Check an append against ``st`` and ``engine`` and build its events (no mutation):
    a rewind's ``tokens.truncated`` (Salience's offset rule), then ``tokens.appended``."""
    info = engine.info
    check_length(len(tokens), info.max_length)  # before any work that grows with it
    tokens = [int(t) for t in tokens]
    check_vocab(tokens, info.vocab_size)
    cut = rewind_point(st, offset, truncating)
    base = st.length if cut is None else cut
    new_len = base + len(tokens)
    check_length(new_len, info.max_length)
    if images:
        block = (
            None
            if info.image_block_tokens is None
            else engine.image_block_length(images[0].data, images[0].mime)
        )
        check_images(images, base, new_len, block, tokens, info.image_pad_token_id)
    out: list[NewEvent] = []
    if cut is not None:
        out.append(
            NewEvent(T.TOKENS_TRUNCATED, tokens_truncated("rewind", [[0, cut]], st.length - cut))
        )
    if tokens or images:
        imgs = [
            {"start": im.start, "end": im.end, "mime": im.mime, "sha256": sha, "size": size}
            for im, (sha, size) in zip(images, image_blobs, strict=True)
        ]
        out.append(NewEvent(T.TOKENS_APPENDED, {"start": base, "tokens": tokens, "images": imgs}))
    return out
