"""The server's collector and GIL settings (run in a child process: they are process-wide)."""

from __future__ import annotations

import subprocess
import sys


def test_serving_freezes_the_startup_heap_collects_the_young_less_often_and_switches_sooner() -> (
    None
):
    code = (
        "import gc\n"
        "from sessiontape.core import gctune\n"
        "keep = [[i] for i in range(1000)]\n"
        "assert gc.get_freeze_count() == 0\n"
        "gctune.tune_for_serving()\n"
        "assert gc.get_freeze_count() >= 1000, gc.get_freeze_count()\n"
        "assert gc.get_threshold()[0] == gctune.YOUNG_THRESHOLD\n"
        "assert gc.isenabled()\n"
        "import sys\n"
        "assert sys.getswitchinterval() == gctune.SWITCH_INTERVAL_S < 0.005\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def _in_child(code: str) -> None:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_serve_leaves_the_interpreter_alone_unless_the_server_setting_asks() -> None:
    _in_child(
        "import gc, sys\n"
        "from sessiontape.core import gctune\n"
        "from sessiontape.core.config import Config\n"
        "before = (gc.get_threshold(), sys.getswitchinterval(), gc.get_freeze_count())\n"
        "cfg = Config.load(environ={})\n"
        "assert cfg.server.tune_interpreter is False\n"
        "assert gctune.apply(cfg.server) is False\n"
        "assert (gc.get_threshold(), sys.getswitchinterval(), gc.get_freeze_count()) == before\n"
        "cfg = Config.load(environ={'SESSIONTAPE_SERVER__TUNE_INTERPRETER': 'true'})\n"
        "assert gctune.apply(cfg.server) is True\n"
        "assert gc.get_threshold()[0] == gctune.YOUNG_THRESHOLD\n"
        "assert sys.getswitchinterval() == gctune.SWITCH_INTERVAL_S\n"
        "print('ok')\n"
    )
