"""Inputs the tool fuzz suites share (tests/fuzz/test_evergreen_tools_fuzz.py,
test_openai_tools_fuzz.py): function names, JSON Schemas llguidance takes or refuses, and junk
of every JSON type."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import strategies as st

from tests.helpers.schemas import ZONE_TIME as TIME

SCHEMAS: list[Any] = [
    TIME,
    {"type": "object", "properties": {}},
    {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4.0}}},
    {"type": "object", "properties": {"x": {"type": "frob"}}},  # refused by llguidance
    {"type": "object", "properties": {"x": {"$ref": "#/nowhere"}}},
    {"type": "object", "properties": {"x": {"pattern": "(", "type": "string"}}},
    {"type": "object", "properties": {"x": {"minimum": 5, "maximum": 1, "type": "integer"}}},
    {"type": "string"},
    {"type": "object", "required": ["missing"], "additionalProperties": False},
    {"allOf": [{"type": "integer"}, {"type": "string"}]},
    {"type": "object", "properties": {"n": {"type": "number", "multipleOf": 0.0}}},
]
NAMES = st.one_of(
    st.sampled_from(
        ["get_time", "f", "a-b_9", "x" * 64, "x" * 65, "", "no spaces", "é", "get_time"]
    ),
    st.text(max_size=8),
)


def _nested(depth: int) -> Any:
    value: Any = "leaf"
    for i in range(depth):
        value = {"k": value} if i % 2 else [value]
    return value


JUNK: st.SearchStrategy[Any] = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e300, -0.0, 2.0**64, 0.5]),
    st.text(max_size=10),
    st.sampled_from(["x" * 100_000, "\u0000", "auto", "none", "required"]),
    st.integers(1, 120).map(_nested),
    st.recursive(
        st.one_of(st.none(), st.booleans(), st.floats(), st.text(max_size=4)),
        lambda inner: st.one_of(
            st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)
        ),
        max_leaves=8,
    ),
)
