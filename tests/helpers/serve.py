"""A ``sessiontape serve`` process started and stopped as a user would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def start(
    tmp_path: Path, *args: str, cache: Path | None = None
) -> tuple[subprocess.Popen[str], list[str]]:
    env = {**os.environ, "SESSIONTAPE_CACHE": str(cache or tmp_path / "cache")}
    if cache is not None:  # the newcomer's default: the real model, not the suite's demo
        env.pop("SESSIONTAPE_DEFAULT_MODEL", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sessiontape.core.cli",
            "serve",
            "--db",
            f"sqlite+aiosqlite:///{tmp_path / 'st.db'}",
            *args,
        ],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    lines: list[str] = []
    assert proc.stderr is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line.rstrip())
        if "sessiontape ready" in line:
            return proc, lines
    proc.kill()
    raise AssertionError("server did not start:\n" + "\n".join(lines))


def stop(proc: subprocess.Popen[str]) -> tuple[int, str]:
    proc.send_signal(signal.SIGTERM)
    rest = proc.communicate(timeout=30)[1]
    return proc.returncode, rest
