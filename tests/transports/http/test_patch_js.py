"""The viewer's JSON Patch+ applier (static/patch.js) against the cases core/patch.py passes.

``node`` runs patch_cases.mjs, which applies every case of tests/data/json_patch_cases.json
both ways the viewer calls ``applyPatch`` (on a copy, and in place on a document it owns) and
prints what came out; each case is judged here as tests/core/test_patch_cases.py judges the
server's applier: the expected document, or a PatchError with the input left as it was.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from sessiontape.transports.http.viewer import STATIC
from tests.helpers.patch_cases import CASES, CASES_FILE, json_same

NODE = shutil.which("node")
RUNNER = Path(__file__).with_name("patch_cases.mjs")
PATCH_JS = STATIC / "patch.js"

pytestmark = pytest.mark.skipif(NODE is None, reason="node is not on PATH: patch.js is not run")


@pytest.fixture(scope="module")
def js() -> dict[str, Any]:
    assert NODE is not None
    done = subprocess.run(
        [NODE, str(RUNNER), str(PATCH_JS), str(CASES_FILE)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out: dict[str, Any] = json.loads(done.stdout)
    assert [r["comment"] for r in out["results"]] == [c["comment"] for c in CASES]
    return out


def test_the_viewer_loads_the_applier_the_runner_tests() -> None:
    app_js = (PATCH_JS.parent / "app.js").read_text(encoding="utf-8")
    assert 'import { applyPatch } from "/static/patch.js";' in app_js


def test_nothing_leaks_onto_the_prototypes(js: dict[str, Any]) -> None:
    assert js["polluted"] == []


@pytest.mark.parametrize("way", ["copy", "inPlace"])
@pytest.mark.parametrize("n", range(len(CASES)), ids=[c["comment"] for c in CASES])
def test_case(js: dict[str, Any], n: int, way: str) -> None:
    case, got = CASES[n], js["results"][n][way]
    if "error" in case:
        assert "error" in got, f"applied instead of refused ({case['error']}): {got.get('result')}"
        assert got["patchError"], got["error"]  # a PatchError, not a TypeError from inside
        assert got["unchanged"], "a refused patch changed the document"
    else:
        assert "error" not in got, got["error"]
        assert "result" in got, "applyPatch returned undefined"
        assert json_same(got["result"], case["expected"]), got["result"]
    if way == "copy":
        assert got["unchanged"], "applyPatch without inPlace changed its input"
