"""The committed generated code is exactly what scripts/gen_protos.py makes from the schemas."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import grpc
import pytest

REPO = Path(__file__).resolve().parents[3]
PROTOS = REPO.parent / "shared" / "protos"
GEN = REPO / "transports" / "grpc" / "gen"


def _script() -> object:
    spec = importlib.util.spec_from_file_location("gen_protos", REPO / "scripts" / "gen_protos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


@pytest.mark.skipif(not PROTOS.is_dir(), reason=f"wire schemas not checked out at {PROTOS}")
def test_regenerating_changes_nothing(tmp_path: Path) -> None:
    committed = (GEN / "evergreen" / "v2" / "evergreen_pb2_grpc.py").read_text()
    made_with = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", committed)
    assert made_with is not None
    if made_with.group(1) != grpc.__version__:
        pytest.skip(f"committed code was generated with grpcio-tools {made_with.group(1)}, "
                    f"installed is {grpc.__version__}: output may differ by version")
    _script().generate(PROTOS, tmp_path / "gen")  # type: ignore[attr-defined]
    fresh, old = _tree(tmp_path / "gen"), _tree(GEN)
    assert sorted(fresh) == sorted(old), "file set differs: run python scripts/gen_protos.py"
    changed = [name for name in fresh if fresh[name] != old[name]]
    assert not changed, f"stale generated code {changed}: run python scripts/gen_protos.py"


def test_generated_code_imports_as_a_package() -> None:
    from transports.grpc.gen.evergreen.v2 import evergreen_pb2, evergreen_pb2_grpc
    from transports.grpc.gen.kakeya.v1 import runtime_pb2_grpc
    from transports.grpc.gen.salience.v1 import salience_pb2_grpc

    assert evergreen_pb2_grpc.EvergreenServiceStub is not None
    assert salience_pb2_grpc.SalienceStub is not None
    assert runtime_pb2_grpc.RuntimeServiceStub is not None
    # No top-level "evergreen" package was put on sys.path to make this work.
    assert "evergreen" not in sys.modules
    assert evergreen_pb2.SessionMessage.__module__ == "transports.grpc.gen.evergreen.v2.evergreen_pb2"
