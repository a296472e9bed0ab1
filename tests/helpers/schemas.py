"""Hypothesis strategies of JSON Schemas: OpenAI's strict subset (every property required,
no additional properties), nested objects and arrays of strings, numbers, booleans, enums
and nullable strings, for the constrained-decoding property tests."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

_NAMES = st.from_regex(r"[a-z]{1,6}", fullmatch=True)


#: the tool parameter schemas the tool tests share: a city's weather, the time in a city, and
#: the time in a UTC offset
WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
CITY_TIME: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
ZONE_TIME: dict[str, Any] = {
    "type": "object",
    "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["zone"],
    "additionalProperties": False,
}


def _leaf() -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.just({"type": "string", "maxLength": 8}),
        st.just({"type": "integer"}),
        st.just({"type": "number"}),
        st.just({"type": "boolean"}),
        st.lists(_NAMES, min_size=1, max_size=4, unique=True).map(
            lambda xs: {"type": "string", "enum": xs}
        ),
        st.just({"type": ["string", "null"], "maxLength": 5}),
    )


def _object(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.dictionaries(_NAMES, children, min_size=1, max_size=4).map(
        lambda props: {
            "type": "object",
            "properties": props,
            "required": list(props),
            "additionalProperties": False,
        }
    )


STRICT_SCHEMAS = _object(
    st.recursive(
        _leaf(),
        lambda inner: st.one_of(
            _object(inner),
            inner.map(lambda items: {"type": "array", "items": items, "maxItems": 3}),
        ),
        max_leaves=6,
    )
)
