"""Function and module length rules for the package (scripts/check runs this).

No function over 80 lines and no module over 600 lines in core/, engines/,
transports/ and sessiontape/ (generated code aside). The functions and modules
that passed the limits when the rule came in are listed in
scripts/lengths-allowed.txt with their length then: they may shrink, never
grow, and a new offender fails. Splitting one below its limit means deleting
its line from the file (the check says so when a listed one is within limits).

    .venv/bin/python scripts/lengths.py            # check
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("core", "engines", "transports", "sessiontape")
MAX_FUNCTION, MAX_MODULE = 80, 600
ALLOWED = ROOT / "scripts" / "lengths-allowed.txt"


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


def allowed() -> dict[str, int]:
    out: dict[str, int] = {}
    for line in ALLOWED.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, n = line.rpartition(" ")
            out[key.strip()] = int(n)
    return out


def main() -> int:
    over, allow = measure(), allowed()
    problems = []
    for key, n in sorted(over.items()):
        limit = MAX_MODULE if "::" not in key else MAX_FUNCTION
        if key not in allow:
            problems.append(f"{key}: {n} lines (limit {limit})")
        elif n > allow[key]:
            problems.append(f"{key}: {n} lines, grew from {allow[key]} (limit {limit})")
    for key in sorted(set(allow) - set(over)):
        problems.append(f"{key}: within its limit now: delete its line from {ALLOWED.name}")
    for p in problems:
        print(f"lengths: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
