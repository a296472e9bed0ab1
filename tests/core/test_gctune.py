"""The server's collector settings (run in a child process: they are process-wide)."""

from __future__ import annotations

import subprocess
import sys


def test_serving_freezes_the_startup_heap_and_collects_the_young_less_often() -> None:
    code = (
        "import gc\n"
        "from sessiontape.core import gctune\n"
        "keep = [[i] for i in range(1000)]\n"
        "assert gc.get_freeze_count() == 0\n"
        "gctune.tune_for_serving()\n"
        "assert gc.get_freeze_count() >= 1000, gc.get_freeze_count()\n"
        "assert gc.get_threshold()[0] == gctune.YOUNG_THRESHOLD\n"
        "assert gc.isenabled()\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
