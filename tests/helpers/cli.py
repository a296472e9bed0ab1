"""The ``sessiontape`` command run as a child process against a database."""

from __future__ import annotations

import os
import subprocess
import sys

EXE = [sys.executable, "-m", "sessiontape.core.cli"]


def cli(*args: str, db: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SESSIONTAPE_DB": db}
    proc = subprocess.run([*EXE, *args], capture_output=True, text=True, env=env, timeout=60)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} failed ({proc.returncode}): {proc.stderr}")
    return proc
