"""Byte-level tokenizer: ids 0-255 are bytes; specials follow."""

from __future__ import annotations

from collections.abc import Sequence


class ByteTokenizer:
    def __init__(self, vocab_size: int = 259) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        if not isinstance(ids, list | tuple):
            # an array or a buffer would give bytes() its memory, not its values
            ids = list(ids)
        try:
            raw = bytes(ids)  # all bytes (no specials): the common case, without a Python loop
        except (ValueError, TypeError):
            raw = bytes(i for i in ids if 0 <= i < 256)  # specials have no text
        return raw.decode("utf-8", errors="replace")
