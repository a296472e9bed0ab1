"""An install keeps the GPU: nothing brings the CPU-only `onnxruntime` beside `onnxruntime-gpu`.

Both distributions install the same `onnxruntime` package; whichever was
installed last owns its files, so a CPU build beside the GPU one silently
takes the CUDA provider away (onnxruntime-genai's CPU package depends on it).
"""

from __future__ import annotations

import importlib.metadata as md
import re
import tomllib
from pathlib import Path

from sessiontape.engines.onnx.runner import CUDA, quiet_ort

ROOT = Path(__file__).resolve().parents[2]
#: distributions that depend on the CPU-only onnxruntime
CPU_ONLY = {"onnxruntime", "onnxruntime-genai", "onnxruntime-directml"}


def _name(requirement: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9._-]+)", requirement)
    assert m, requirement
    return m.group(1).lower().replace("_", "-")


def test_no_install_path_names_the_cpu_only_onnxruntime() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    paths = {"dependencies": project["dependencies"], **project["optional-dependencies"]}
    for path, reqs in paths.items():
        bad = sorted({_name(r) for r in reqs} & CPU_ONLY)
        assert not bad, f"{path} installs {bad}, which bring the CPU-only onnxruntime"
    assert "onnxruntime-gpu" in {_name(r) for r in project["dependencies"]}


def test_the_cpu_only_onnxruntime_is_not_installed_beside_onnxruntime_gpu() -> None:
    def where(name: str) -> set[Path]:
        return {
            Path(str(d.locate_file(""))).resolve()
            for d in md.distributions()
            if (d.metadata["Name"] or "").lower() == name
        }

    gpu, cpu = where("onnxruntime-gpu"), where("onnxruntime")
    assert not gpu & cpu, (
        f"onnxruntime and onnxruntime-gpu are both installed in {sorted(gpu & cpu)}"
    )
    if gpu:
        # the module that imports is the GPU build (it lists the CUDA provider with or without a GPU)
        assert CUDA in quiet_ort().get_available_providers()
