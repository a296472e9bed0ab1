"""``sessiontape nostr call`` as a new user meets it: a relay that is down, an id that is not one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers.config import free_port

EXE = str(Path(sys.executable).parent / "sessiontape")
FID = "ab" * 32


def call(*args: str) -> subprocess.CompletedProcess[str]:
    # far below --timeout's 60 s: a call that waits for it fails here with TimeoutExpired
    return subprocess.run(
        [EXE, "nostr", "call", "--prompt", "Hello", *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_a_relay_that_is_down_fails_at_once() -> None:
    url = f"ws://127.0.0.1:{free_port()}"
    proc = call("--relay", url, "--function", FID, "--timeout", "60")
    assert proc.returncode == 1
    assert proc.stdout == ""
    [line] = proc.stderr.strip().splitlines()
    assert (
        line.startswith(f"sessiontape: error: cannot reach any relay ({url}") and "refused" in line
    )


def test_a_function_id_must_be_64_hex_digits() -> None:
    for bad in ("hello", "ab" * 31, "zz" * 32, "ab" * 32 + "00"):
        proc = call("--relay", "ws://127.0.0.1:9", "--function", bad)
        assert proc.returncode == 2, bad
        assert f"not a nostr event id (64 hex digits): {bad!r}" in proc.stderr
    proc = call("--relay", "ws://127.0.0.1:9", "--function", FID, "--continue", "123")
    assert proc.returncode == 2 and "--continue" in proc.stderr
