"""The committed generated code is exactly what scripts/gen_protos.py makes from the schemas.

The schemas are vendored in transports/grpc/protos, so the regeneration check
runs in any clone; a second check holds the vendored copies to the shared
originals (../shared/protos) when those sit beside the clone.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[3]
VENDORED = REPO / "transports" / "grpc" / "protos"
SHARED = REPO.parent / "shared" / "protos"
GEN = REPO / "transports" / "grpc" / "gen"
SCHEMAS = ["evergreen/v2/evergreen.proto", "kakeya/v1/runtime.proto", "salience/v1/salience.proto"]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_protos", REPO / "scripts" / "gen_protos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tree(root: Path, pattern: str = "*") -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob(pattern))
        if p.is_file() and "__pycache__" not in p.parts
    }


def _pins() -> dict[str, str]:
    """Exact ``name==version`` pins in the dev extra (the generators)."""
    dev = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"][
        "dev"
    ]
    pins: dict[str, str] = {}
    for d in dev:
        m = re.fullmatch(r"([\w.-]+)==([\w.]+)", d)
        if m:
            pins[m.group(1)] = m.group(2)
    return pins


def _lower_bound(name: str) -> tuple[int, ...]:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    for d in deps:
        m = re.fullmatch(rf"{re.escape(name)}>=([\d.]+)(?:,.*)?", d)
        if m:
            return tuple(int(x) for x in m.group(1).split("."))
    raise AssertionError(f"{name} has no >= bound in [project].dependencies")


def test_vendored_schemas_are_the_three_wire_contracts() -> None:
    assert sorted(_tree(VENDORED, "*.proto")) == SCHEMAS


def test_regenerating_from_vendored_schemas_changes_nothing(tmp_path: Path) -> None:
    # Output varies with the generator versions, so they are pinned in the dev
    # extra; a different install is a setup error, not a reason to skip.
    pins = _pins()
    for tool in ("grpcio-tools", "mypy-protobuf"):
        installed = importlib.metadata.version(tool)
        assert installed == pins.get(tool), (
            f"{tool} {installed} installed, dev extra pins {pins.get(tool)}: "
            "pip install -e '.[dev]' (or bump the pin and run python scripts/gen_protos.py)"
        )
    committed = (GEN / "evergreen" / "v2" / "evergreen_pb2_grpc.py").read_text()
    assert f"GRPC_GENERATED_VERSION = '{pins['grpcio-tools']}'" in committed, (
        "committed code was made by another grpcio-tools: run python scripts/gen_protos.py"
    )

    _script().generate(VENDORED, tmp_path / "gen")
    fresh, old = _tree(tmp_path / "gen"), _tree(GEN)
    assert sorted(fresh) == sorted(old), "file set differs: run python scripts/gen_protos.py"
    changed = [name for name in fresh if fresh[name] != old[name]]
    assert not changed, f"stale generated code {changed}: run python scripts/gen_protos.py"


@pytest.mark.skipif(
    not SHARED.is_dir(), reason=f"shared wire schemas not beside the clone at {SHARED}"
)
def test_vendored_schemas_equal_the_shared_ones() -> None:
    shared, vendored = _tree(SHARED, "*.proto"), _tree(VENDORED, "*.proto")
    assert sorted(vendored) == sorted(shared), (
        "schema set differs: copy ../shared/protos into transports/grpc/protos"
    )
    changed = [name for name in shared if shared[name] != vendored[name]]
    assert not changed, (
        f"vendored {changed} differ from ../shared/protos: copy them, then run python scripts/gen_protos.py"
    )


def test_runtime_dependencies_accept_the_generated_code() -> None:
    # The generated modules refuse to import on an older grpcio or protobuf
    # runtime than the generator's, so the install floor must be at least that.
    grpc_made = re.search(
        r"GRPC_GENERATED_VERSION = '([\d.]+)'",
        (GEN / "evergreen" / "v2" / "evergreen_pb2_grpc.py").read_text(),
    )
    pb_made = re.search(
        r"^# Protobuf Python Version: ([\d.]+)$",
        (GEN / "evergreen" / "v2" / "evergreen_pb2.py").read_text(),
        re.M,
    )
    assert grpc_made is not None and pb_made is not None
    assert _lower_bound("grpcio") >= tuple(int(x) for x in grpc_made.group(1).split("."))
    assert _lower_bound("protobuf") >= tuple(int(x) for x in pb_made.group(1).split("."))


def test_generated_code_imports_as_a_package() -> None:
    from sessiontape.transports.grpc.gen.evergreen.v2 import evergreen_pb2, evergreen_pb2_grpc
    from sessiontape.transports.grpc.gen.kakeya.v1 import runtime_pb2_grpc
    from sessiontape.transports.grpc.gen.salience.v1 import salience_pb2_grpc

    assert evergreen_pb2_grpc.EvergreenServiceStub is not None
    assert salience_pb2_grpc.SalienceStub is not None
    assert runtime_pb2_grpc.RuntimeServiceStub is not None
    # No top-level "evergreen" package was put on sys.path to make this work.
    assert "evergreen" not in sys.modules
    assert (
        evergreen_pb2.SessionMessage.__module__
        == "sessiontape.transports.grpc.gen.evergreen.v2.evergreen_pb2"
    )
