"""The byte-level tokenizer of the reference engine and the demo models."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sessiontape.engines.byte_tokenizer import ByteTokenizer


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.lists(st.integers(min_value=-3, max_value=300), max_size=40))
def test_decode_is_the_utf8_of_the_byte_ids(ids: list[int]) -> None:
    """Ids 0-255 are bytes (invalid UTF-8 becomes U+FFFD); specials and anything
    else have no text."""
    expected = bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
    assert ByteTokenizer().decode(ids) == expected


def test_round_trip_from_any_sequence() -> None:
    """Lists, tuples, arrays and numpy arrays of ids decode by their values."""
    import array

    import numpy as np

    tok = ByteTokenizer()
    text = "añ€😀 plain"
    ids = tok.encode(text)
    assert tok.decode(ids) == tok.decode(tuple(ids)) == text
    assert tok.decode([*ids, 256, 258]) == text
    assert tok.decode(array.array("I", ids)) == tok.decode(array.array("q", ids)) == text
    assert tok.decode(np.asarray(ids, dtype=np.int64)) == text
    assert tok.decode(np.asarray([*ids, 257], dtype=np.int32)) == text
