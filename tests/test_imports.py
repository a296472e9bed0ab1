"""The import graph of the source packages: no cycles, and core imports no transport or engine.

Read statically (``ast``), so every import counts, those inside functions
included: a lazy import that closes a cycle is still a tangle. Imports
under ``if TYPE_CHECKING:`` are annotations only and never run; they count
for the layering rule (core must not even name a transport or an engine);
cycles they close fail too (ANNOTATION_CYCLES_LEFT is empty: the generation loop names
what it needs of the runtime as a Protocol instead of importing it).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: the folders at the top of the repository; each installs as ``sessiontape.<folder>``
#: (pyproject.toml's package-dir), and sessiontape/ is the package ``sessiontape`` itself.
SUBPACKAGES = ("core", "engines", "transports", "migrations")
PACKAGES = (*SUBPACKAGES, "sessiontape")


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            if pkg != "sessiontape":
                parts.insert(0, "sessiontape")
            out[".".join(parts)] = path
    return out


def _package(module: str) -> str:
    """Which of PACKAGES a module of ours belongs to (its folder)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in SUBPACKAGES else parts[0]


MODULES = _modules()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(
    tree: ast.AST, typing_only: bool = False
) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement with whether it sits under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), True)
            for child in node.orelse:
                yield from _imports(ast.Module(body=[child], type_ignores=[]), typing_only)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, typing_only
        yield from _imports(node, typing_only)


def _known(name: str) -> str | None:
    """The module of ours that importing ``name`` loads (the longest known prefix)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = (
                module.split(".")
                if MODULES[module].name == "__init__.py"
                else module.split(".")[:-1]
            )
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join([*pkg, base] if base else pkg)
        # ``from pkg import sub`` loads pkg.sub when it is a module, else just pkg
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    return {t for t in map(_known, names) if t is not None and t != module}


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(run-time edges, all edges including annotation-only ones)."""
    runtime: dict[str, set[str]] = {m: set() for m in MODULES}
    every: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for node, typing_only in _imports(ast.parse(path.read_text(), str(path))):
            targets = _targets(module, node)
            every[module] |= targets
            if not typing_only:
                runtime[module] |= targets
    return runtime, every


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


RUNTIME, EVERY = _graph()


def test_the_walk_sees_the_packages() -> None:
    assert {
        "sessiontape.core.runtime",
        "sessiontape.core.log.store",
        "sessiontape.transports.nostr.worker",
        "sessiontape.migrations.runner",
    } <= set(MODULES)
    assert "sessiontape.core.session.state" in RUNTIME["sessiontape.core.nodes"]
    assert (
        "sessiontape.migrations.runner" in RUNTIME["sessiontape.core.log.store"]
    )  # an import inside a function


def test_a_cycle_is_found() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_modules() -> None:
    cycles = _cycles(RUNTIME)
    detail = {" <-> ".join(c): {m: sorted(RUNTIME[m] & set(c)) for m in c} for c in cycles}
    assert cycles == [], f"import cycles: {detail}"


#: cycles closed only by annotation imports, left to untangle (a ratchet: the test fails on a new
#: one, and on a listed one that is gone, so the list only shrinks).
ANNOTATION_CYCLES_LEFT: list[list[str]] = []


def test_no_new_cycle_through_annotations() -> None:
    assert _cycles(EVERY) == ANNOTATION_CYCLES_LEFT


def test_no_import_cycle_between_packages() -> None:
    top: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for module, targets in RUNTIME.items():
        top[_package(module)] |= {_package(t) for t in targets} - {_package(module)}
    assert _cycles(top) == [], f"packages import each other: {top}"


@pytest.mark.parametrize("forbidden", ["engines", "transports"])
def test_core_imports_no_engine_or_transport(forbidden: str) -> None:
    bad = {
        m: sorted(t for t in targets if _package(t) == forbidden)
        for m, targets in EVERY.items()
        if _package(m) == "core"
    }
    assert {m: t for m, t in bad.items() if t} == {}


def _imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The absolute names an import statement reads (none for a relative one)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return [node.module] if node.module and not node.level else []


def test_ours_are_imported_by_their_installed_names() -> None:
    """``core``, ``engines``, ... are folders: imports say ``sessiontape.core...``.

    From the repository root the folders still import as top-level ``core``,
    ``engines``, ... (the current directory is on ``sys.path``), which would load a
    second copy of a module beside the installed one; the walk above would not see
    such an import either. The tests and the benchmarks are held to it too.
    """
    files = [*MODULES.values(), *sorted((ROOT / "tests").rglob("*.py"))]
    files += sorted((ROOT / "bench").rglob("*.py"))
    stale = [
        f"{path.relative_to(ROOT)}:{node.lineno}: {name}"
        for path in files
        for node, _ in _imports(ast.parse(path.read_text(), str(path)))
        for name in _imported(node)
        if name.split(".")[0] in SUBPACKAGES
    ]
    assert stale == []


def test_transports_reach_the_log_only_through_the_runtime() -> None:
    """No ``runtime.log`` in transports: they ask the runtime (read_events, last_position, ...)."""

    def names_runtime(node: ast.expr) -> bool:
        return (isinstance(node, ast.Name) and node.id in ("runtime", "rt")) or (
            isinstance(node, ast.Attribute) and node.attr == "runtime"
        )

    found = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for module, path in MODULES.items()
        if _package(module) == "transports"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr == "log" and names_runtime(node.value)
    ]
    assert found == []


def _subpackage(module: str, of: str) -> bool:
    return module == of or module.startswith(of + ".")


def test_engines_models_and_onnx_share_the_spec_without_importing_each_other_back() -> None:
    """``engines/models`` reads model files and never names ``engines/onnx``.

    What the importer (models) and the decoder graph builder (onnx) agree on, the model's shape
    and its weights, lives beside both (``sessiontape.engines.model_spec``,
    ``sessiontape.engines.weights``): models -> spec <- onnx. The ONNX engine builds on the
    model files (registry, sampling defaults, tokenizer), so ``onnx`` -> ``models`` is the one
    direction there is; the other would make the two one tangle.
    """
    models, onnx = "sessiontape.engines.models", "sessiontape.engines.onnx"
    back = {
        m: sorted(t for t in targets if _subpackage(t, onnx))
        for m, targets in EVERY.items()
        if _subpackage(m, models)
    }
    assert {m: t for m, t in back.items() if t} == {}
    spec = "sessiontape.engines.model_spec"
    assert spec in EVERY["sessiontape.engines.models.arch"]
    assert spec in EVERY["sessiontape.engines.onnx.decoder"]
    assert not any(_subpackage(t, models) or _subpackage(t, onnx) for t in EVERY[spec])


def _test_module_names() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        out[".".join(path.relative_to(ROOT).with_suffix("").parts)] = path
    return out


def _imports_of_test_modules(
    path: Path, tests: dict[str, Path], text: str | None = None
) -> list[str]:
    """The test modules that ``path`` (read as ``text`` when given) imports, as ``file:line: name``."""
    here = path.relative_to(ROOT).with_suffix("").parts[:-1]
    found = []
    source = path.read_text() if text is None else text
    for node, _ in _imports(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                pkg = list(here[: len(here) - (node.level - 1)])
                base = ".".join([*pkg, base] if base else pkg)
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
        found += [f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n in tests]
    return found


def test_a_test_module_imports_no_other_test_module() -> None:
    """Tests share helpers through ``tests/helpers/`` and conftest.py, never through a test module
    (importing one runs its module-level fixtures' imports under ``noqa`` and ties the two files)."""
    tests = _test_module_names()
    probe = ROOT / "tests" / "core" / "test_probe.py"
    fake = "import tests.test_imports\nfrom . import test_config\nfrom tests.helpers import x\n"
    assert len(_imports_of_test_modules(probe, tests, fake)) == 2
    files = sorted((ROOT / "tests").rglob("*.py"))
    found = {
        line.split(":")[0] + ": " + line.rpartition(": ")[2]
        for path in files
        for line in _imports_of_test_modules(path, tests)
    }
    assert not found, sorted(found)
