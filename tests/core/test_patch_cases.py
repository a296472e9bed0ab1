"""core/patch.py against the JSON Patch+ cases it shares with the viewer's patch.js.

tests/data/json_patch_cases.json holds the RFC 6902 Appendix A examples, the JSON Patch+
``append`` cases and the edges of every op; tests/transports/http/test_patch_js.py runs the same
file against transports/http/viewer/static/patch.js. ``load_cases`` and ``json_same`` serve both.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from sessiontape.core.errors import InvalidPatch
from sessiontape.core.patch import apply_patch
from tests.helpers.patch_cases import CASES, json_same


def test_the_cases_are_well_formed() -> None:
    names = [c["comment"] for c in CASES]
    assert len(names) == len(set(names)), "case comments name the cases: keep them unique"
    for c in CASES:
        assert {"comment", "doc", "patch"} <= c.keys(), c["comment"]
        assert ("expected" in c) != ("error" in c), c["comment"]
    assert sum("append" in json.dumps(c["patch"]) for c in CASES) >= 10
    appendix = {c["comment"].split()[0] for c in CASES if c["comment"].startswith("A.")}
    assert appendix == {f"A.{i}" for i in range(1, 17)} - {"A.13"}  # A.13: see the file's about


def test_json_same_is_strict_where_python_is_not() -> None:
    assert json_same({"a": [1, {"b": 2.0}]}, {"a": [1.0, {"b": 2}]})
    assert not json_same(True, 1) and not json_same(0, False) and not json_same(None, 0)
    assert not json_same([1, 2], [2, 1]) and not json_same({"a": 1}, {"a": 1, "b": 1})


@pytest.mark.parametrize("case", CASES, ids=[c["comment"] for c in CASES])
def test_case(case: dict[str, Any]) -> None:
    doc = case["doc"]
    before = copy.deepcopy(doc)
    if "error" in case:
        with pytest.raises(InvalidPatch):
            apply_patch(doc, case["patch"])
    else:
        out = apply_patch(doc, case["patch"])
        assert json_same(out, case["expected"]), out
    assert json_same(doc, before) and json.dumps(doc) == json.dumps(before)  # untouched
