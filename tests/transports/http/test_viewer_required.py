"""SESSIONTAPE_REQUIRE_BROWSER (set by .ci/run): without a browser the viewer test errors instead of skipping.

Runs the viewer test in a child pytest with the browser path pointed at nothing, so it
holds on machines that have Chromium too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize(("required", "outcome"), [("1", "error"), ("", "skipped")])
def test_a_missing_browser_fails_when_required(required: str, outcome: str) -> None:
    """The CI sets SESSIONTAPE_REQUIRE_BROWSER=1: there a missing browser must not pass as a skip."""
    env = {
        **os.environ,
        "SESSIONTAPE_CHROMIUM": "/nonexistent/chromium",
        "SESSIONTAPE_REQUIRE_BROWSER": required,
    }
    root = Path(__file__).resolve().parents[3]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
            "tests/transports/http/viewer/test_viewer.py::test_list_live_session_and_scrubber",
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert f"1 {outcome}" in proc.stdout, proc.stdout[-2000:]
    assert (proc.returncode != 0) == (outcome == "error")
    if outcome == "error":
        assert "no browser at /nonexistent/chromium" in proc.stdout
