"""The HTTP transport's JSON encoder (transports/http/server/json_encoding.py): orjson with the
standard library behind it, compact UTF-8, parsing back to what was given."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from sessiontape.transports.http.server.json_encoding import JSONResponse, dump_bytes, dumps

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=30,
)


@settings(max_examples=300, derandomize=True, database=None)
@given(JSON_VALUES)
def test_a_body_parses_back_to_the_value_and_is_compact_utf8(value: Any) -> None:
    body = JSONResponse(value).body
    assert json.loads(body) == value
    assert body == dump_bytes(value)
    assert dumps(value) == body.decode("utf-8")
    standard = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    if not _has_float(value):  # floats may be spelt differently (1e-07 / 1e-7)
        assert body.decode("utf-8") == standard


def _has_float(value: Any) -> bool:
    if isinstance(value, float):
        return True
    if isinstance(value, list):
        return any(_has_float(v) for v in value)
    if isinstance(value, dict):
        return any(_has_float(v) for v in value.values())
    return False


def test_what_orjson_refuses_goes_through_the_standard_library() -> None:
    value = {"big": 2**70, "text": "é\u2028", 1: "an int key"}
    assert JSONResponse(value).body == json.dumps(
        value, separators=(",", ":"), ensure_ascii=False
    ).encode("utf-8")


def test_a_non_finite_float_is_null_not_an_error() -> None:
    assert JSONResponse({"lp": float("-inf"), "x": float("nan")}).body == b'{"lp":null,"x":null}'


def test_the_response_keeps_starlettes_media_type_and_status() -> None:
    r = JSONResponse({"ok": True}, status_code=201, headers={"x-a": "b"})
    assert r.status_code == 201
    assert r.media_type == "application/json"
    assert r.headers["content-length"] == str(len(b'{"ok":true}'))
    assert r.headers["x-a"] == "b"
