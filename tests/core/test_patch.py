"""JSON Patch+: pointers, every op, all-or-nothing errors, diff round trips, agreement with jsonpatch."""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sessiontape.core.errors import InvalidArgument, InvalidPatch
from sessiontape.core.patch import apply_patch, diff, parse_pointer, pointer, resolve, to_rfc6902

keys = st.text(alphabet="ab~/-0", min_size=0, max_size=3)
scalars = st.none() | st.booleans() | st.integers(-5, 5) | st.text(alphabet="xyz", max_size=4)
json_values = st.recursive(
    scalars,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(keys, kids, max_size=4),
    max_leaves=12,
)


def test_pointer_escaping_round_trips() -> None:
    assert parse_pointer("/a~1b/c~0d/~01") == ["a/b", "c~d", "~1"]
    assert pointer("a/b", "c~d") == "/a~1b/c~0d"
    assert parse_pointer("") == []
    doc = {"a/b": {"": [1, 2]}}
    assert resolve(doc, "/a~1b//1") == 2


@pytest.mark.parametrize("bad", ["a", "/~2", "/~", "/x~"])
def test_bad_pointers_are_rejected(bad: str) -> None:
    with pytest.raises(InvalidPatch):
        parse_pointer(bad)


def test_append_to_string_and_array() -> None:
    doc = {"t": "Hel", "xs": [1]}
    out = apply_patch(
        doc,
        [
            {"op": "append", "path": "/t", "value": "lo"},
            {"op": "append", "path": "/xs", "value": [2]},
        ],
    )
    assert out == {"t": "Hello", "xs": [1, [2]]}
    assert doc == {"t": "Hel", "xs": [1]}


def test_add_dash_appends_and_test_op() -> None:
    out = apply_patch(
        {"a": [1]},
        [
            {"op": "add", "path": "/a/-", "value": 2},
            {"op": "test", "path": "/a", "value": [1, 2.0]},
        ],
    )
    assert out == {"a": [1, 2]}
    with pytest.raises(InvalidPatch):
        apply_patch({"a": True}, [{"op": "test", "path": "/a", "value": 1}])


BAD_PATCHES: list[Any] = [
    {"op": "add"},  # not an array
    [{"op": "frobnicate", "path": "/a"}],  # unknown op
    [{"op": "add", "path": "/a"}],  # no value
    [{"op": "add", "path": 3, "value": 1}],  # path not a string
    [{"op": "remove", "path": "/missing"}],
    [{"op": "replace", "path": "/xs/5", "value": 1}],
    [{"op": "add", "path": "/xs/01", "value": 1}],  # leading zero
    [{"op": "move", "from": "/o", "path": "/o/child"}],  # into itself
    [{"op": "copy", "path": "/b"}],  # no from
    [{"op": "append", "path": "/n", "value": 1}],  # number target
    [{"op": "append", "path": "/s", "value": 1}],  # non-string to string
    [{"op": "test", "path": "/s", "value": "other"}],
    [{"op": "remove", "path": ""}],
    ["not an op"],
    # a valid op first: the whole patch must still be rejected
    [{"op": "add", "path": "/new", "value": 1}, {"op": "remove", "path": "/nope"}],
]


@pytest.mark.parametrize("patch", BAD_PATCHES)
def test_malformed_patches_are_typed_errors_and_leave_the_document(patch: Any) -> None:
    doc = {"xs": [1, 2], "o": {"k": 1}, "n": 3, "s": "str"}
    before = copy.deepcopy(doc)
    with pytest.raises(InvalidPatch) as info:
        apply_patch(doc, patch)
    assert isinstance(info.value, InvalidArgument)
    assert info.value.code == "invalid_patch"
    assert doc == before


def test_diff_uses_append_for_growth_and_rfc_fallback_has_none() -> None:
    a = {"text": "Hel", "toks": [1, 2]}
    b = {"text": "Hello", "toks": [1, 2, 3]}
    ops = diff(a, b)
    assert ops == [
        {"op": "append", "path": "/text", "value": "lo"},
        {"op": "append", "path": "/toks", "value": 3},
    ]
    rfc = to_rfc6902(ops, b)
    assert all(op["op"] != "append" for op in rfc)
    assert jsonpatch.apply_patch(a, rfc) == b
    assert diff(a, b, plus=False) == [
        {"op": "replace", "path": "/text", "value": "Hello"},
        {"op": "add", "path": "/toks/-", "value": 3},
    ]


@settings(max_examples=300, deadline=None)
@given(json_values, json_values)
def test_apply_diff_round_trips(a: Any, b: Any) -> None:
    ops = diff(a, b)
    assert apply_patch(a, ops) == b
    # the RFC 6902 form reaches the same document, in both appliers
    rfc = to_rfc6902(ops, b)
    assert apply_patch(a, rfc) == b
    assert jsonpatch.apply_patch(copy.deepcopy(a), rfc) == b
    assert jsonpatch.apply_patch(copy.deepcopy(a), diff(a, b, plus=False)) == b
    # the same change, made to a value inside a larger document
    assert apply_patch({"k": [0, a]}, diff(a, b, path="/k/1")) == {"k": [0, b]}


def _paths(doc: Any, prefix: str = "") -> list[str]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, prefix + pointer(k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, f"{prefix}/{i}")
    return out


@st.composite
def doc_and_op(draw: st.DrawFn) -> tuple[Any, dict[str, Any]]:
    doc = draw(st.dictionaries(keys, json_values, min_size=1, max_size=4))
    paths = _paths(doc)
    path = draw(st.sampled_from([*paths, "/zz", "/0/zz", "/~1"]))
    kind = draw(st.sampled_from(["add", "remove", "replace", "move", "copy", "test"]))
    op: dict[str, Any] = {"op": kind, "path": path}
    if kind in ("add", "replace"):
        op["value"] = draw(json_values)
    if kind == "test":
        op["value"] = draw(
            st.sampled_from(["nope", copy.deepcopy(resolve(doc, path)) if path in paths else 0])
        )
    if kind in ("move", "copy"):
        op["from"] = draw(st.sampled_from(paths))
    return doc, op


@settings(max_examples=400, deadline=None)
@given(doc_and_op())
def test_applier_agrees_with_jsonpatch(case: tuple[Any, dict[str, Any]]) -> None:
    doc, op = case
    try:
        theirs: Any = jsonpatch.apply_patch(copy.deepcopy(doc), [op])
    except (
        jsonpatch.JsonPatchException,
        jsonpatch.JsonPointerException,
        KeyError,
        IndexError,
        TypeError,
    ):
        theirs = InvalidPatch
    try:
        ours: Any = apply_patch(doc, [op])
    except InvalidPatch:
        ours = InvalidPatch
    assert ours == theirs
