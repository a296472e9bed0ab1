"""The JSON Patch cases (tests/data/json_patch_cases.json) both the Python and the JavaScript patch code are held to."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CASES_FILE = Path(__file__).resolve().parents[1] / "data" / "json_patch_cases.json"


def load_cases() -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = json.loads(CASES_FILE.read_text(encoding="utf-8"))["cases"]
    return cases


def json_same(a: Any, b: Any) -> bool:
    """JSON equality as RFC 6902 ``test`` means it, written apart from the appliers under test:
    objects by members in any order, arrays element by element, numbers by value, and no kind
    equal to another (``True`` is not ``1``, as Python's ``==`` would have it)."""

    def kind(v: Any) -> type:
        return float if type(v) is int else type(v)

    if kind(a) is not kind(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(json_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(json_same(a[k], b[k]) for k in a)
    return bool(a == b)


CASES = load_cases()
