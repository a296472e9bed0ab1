"""Function and module lengths in the package, as warnings (scripts/check runs this).

A function over 80 lines or a module over 600 lines in core/, engines/, transports/ and
sessiontape/ (generated code aside) is named on stderr. It is a prompt to look, not a
failure: a module holds one concept, whatever its length, and is cut where concepts part,
never just to pass a number. The exit status is 0.

    .venv/bin/python scripts/lengths.py
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("core", "engines", "transports", "sessiontape")
MAX_FUNCTION, MAX_MODULE = 80, 600


def measure() -> dict[str, int]:
    """``{"path": lines, "path::qualname": lines}`` for every module and function over its limit."""
    over: dict[str, int] = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if "/gen/" in rel:
                continue
            text = path.read_text()
            lines = text.count("\n") + (0 if text.endswith("\n") else 1)
            if lines > MAX_MODULE:
                over[rel] = lines
            for name, length in _functions(ast.parse(text)):
                if length > MAX_FUNCTION:
                    over[f"{rel}::{name}"] = length
    return over


def _functions(tree: ast.AST, prefix: str = "") -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = prefix + node.name
            if not isinstance(node, ast.ClassDef):
                out.append((name, (node.end_lineno or node.lineno) - node.lineno + 1))
            out.extend(_functions(node, name + "."))
    return out


def main() -> int:
    """Print a warning per module or function over its limit; the exit status is always 0."""
    for key, n in sorted(measure().items()):
        limit = MAX_MODULE if "::" not in key else MAX_FUNCTION
        print(f"lengths: warning: {key}: {n} lines (limit {limit})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
