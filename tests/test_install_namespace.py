"""One namespace on install: the wheel installs ``sessiontape`` and nothing else beside it.

The folders core/, engines/, transports/ and migrations/ sit at the top of the
repository but install as ``sessiontape.core`` ... ``sessiontape.migrations``
(pyproject.toml's [tool.setuptools.package-dir], setup.py's package list). The
wheel is built here from a copy of the sources (pip, offline, no build
isolation) and read back: its top-level names, that every module of the
folders is in it where the mapping puts it, and that every entry point and the
console script name a module inside it. The editable install the suite runs
under is held to the same names from a directory outside the repository.
"""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("core", "engines", "transports", "migrations")
#: what the build reads: the packaging files and the package folders
SOURCES = ("pyproject.toml", "setup.py", "README.md", "sessiontape", *FOLDERS)
#: files that are not modules but must ship (package data)
DATA = ("migrations/script.py.mako", "transports/http/viewer/static/index.html")


def _installed_path(source: Path) -> str:
    """Where a file of the repository lands in the wheel."""
    rel = source.relative_to(ROOT)
    if rel.parts[0] == "sessiontape":
        return rel.as_posix()
    return f"sessiontape/{rel.as_posix()}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    tmp = tmp_path_factory.mktemp("wheel")
    src, out = tmp / "src", tmp / "out"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=ignore)
        else:
            shutil.copy2(ROOT / name, src / name)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    cmd += ["--no-index", "--quiet", "--wheel-dir", str(out), str(src)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    (built,) = out.glob("sessiontape-*.whl")
    return zipfile.ZipFile(built)


def _dist_info(wheel: zipfile.ZipFile) -> str:
    (info,) = {n.split("/")[0] for n in wheel.namelist() if n.split("/")[0].endswith(".dist-info")}
    return info


@pytest.mark.timeout(60)
def test_the_wheel_installs_only_sessiontape(wheel: zipfile.ZipFile) -> None:
    tops = {name.split("/")[0] for name in wheel.namelist()}
    info = _dist_info(wheel)
    # no .data/ either: its purelib/platlib/scripts would install beside the package
    assert tops == {"sessiontape", info}
    assert wheel.read(f"{info}/top_level.txt").decode().split() == ["sessiontape"]


@pytest.mark.timeout(60)
def test_every_module_is_where_the_mapping_puts_it(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    sources = [
        p
        for folder in ("sessiontape", *FOLDERS)
        for p in sorted((ROOT / folder).rglob("*"))
        if (p.suffix in (".py", ".pyi") or p.name == "py.typed") and "__pycache__" not in p.parts
    ]
    assert len(sources) > 50  # the walk saw the tree
    missing = [_installed_path(p) for p in sources if _installed_path(p) not in names]
    assert missing == []
    for data in DATA:
        assert f"sessiontape/{data}" in names
    # the old top-level layout is nowhere in it
    assert not [n for n in names if n.startswith(tuple(f"{f}/" for f in FOLDERS))]


@pytest.mark.timeout(60)
def test_entry_points_name_modules_in_the_wheel(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    parser = configparser.ConfigParser(delimiters=("=",), interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(wheel.read(f"{_dist_info(wheel)}/entry_points.txt").decode())
    assert parser["console_scripts"]["sessiontape"] == "sessiontape.core.cli:main"
    groups = {
        "sessiontape.engines",
        "sessiontape.transports",
        "sessiontape.grpc_services",
        "sessiontape.commands",
    }
    assert groups <= set(parser.sections())
    for group in parser.sections():
        for name, value in parser[group].items():
            module = value.split(":")[0].strip()
            assert module.startswith("sessiontape."), (group, name, value)
            path = module.replace(".", "/")
            assert f"{path}.py" in names or f"{path}/__init__.py" in names, (group, name, value)


def _outside(code: str, tmp_path: Path) -> str:
    """Run ``code`` in this interpreter from a directory outside the repository."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.timeout(60)
def test_the_editable_install_has_the_same_names(tmp_path: Path) -> None:
    out = _outside(
        "import importlib.util, sys\n"
        "import sessiontape.core.cli, sessiontape.engines.reference\n"
        "import sessiontape.transports.http.plugin, sessiontape.migrations.runner\n"
        "print([n for n in ('core', 'engines', 'transports', 'migrations')"
        " if importlib.util.find_spec(n) is not None])\n"
        "print(sessiontape.core.cli.__file__)\n"
        "print('sessiontape.client' in sys.modules, 'httpx' in sys.modules)\n",
        tmp_path,
    )
    found, cli, client = out.splitlines()
    assert found == "[]"  # no top-level core, engines, ... from outside the repository
    assert Path(cli) == ROOT / "core" / "cli.py"  # the editable install reads the folders
    # the server's packages do not pull in the HTTP client (httpx is not a server dependency)
    assert client == "False False"


@pytest.mark.timeout(60)
def test_the_client_names_still_import_from_the_package(tmp_path: Path) -> None:
    out = _outside(
        "from sessiontape import AsyncClient, Client, Update, errors\n"
        "print(Client.__module__, AsyncClient.__module__, Update.__module__, errors.__name__)\n",
        tmp_path,
    )
    assert out.split() == ["sessiontape.client"] * 3 + ["sessiontape.errors"]


@pytest.mark.timeout(60)
def test_the_console_script_runs(tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "sessiontape"
    if not exe.exists():
        pytest.skip(f"no console script beside {sys.executable} (not an installed environment)")
    done = subprocess.run(
        [str(exe), "--version"], cwd=tmp_path, capture_output=True, text=True, timeout=50
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
