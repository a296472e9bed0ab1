"""Write docs/configuration.md's option tables from the settings classes.

    .venv/bin/python scripts/config_docs.py           # rewrite the tables in place
    .venv/bin/python scripts/config_docs.py --check   # exit 1 when a table is stale

Each table sits between ``<!-- options: NAME -->`` and ``<!-- /options -->``,
NAME being a section (``database``), a transport's table (``transports.grpc``)
or an engine's options (``engine.options.onnx``). The classes are the
configuration's own: core/config.py's sections, and the ``options_class``
each installed engine and transport declares (found through the plugins module,
as the configuration finds them). tests/core/test_config_docs.py runs the check.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from sessiontape.core import plugins
from sessiontape.core.config import SECTIONS
from sessiontape.core.settings_framework import markdown_table

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
BLOCK = re.compile(r"(<!-- options: (\S+) -->\n)(.*?)(<!-- /options -->)", re.DOTALL)


def tables() -> dict[str, type[Any]]:
    """Every table the page must show: NAME -> settings class."""
    out: dict[str, type[Any]] = dict(SECTIONS)
    for group, prefix in (
        (plugins.TRANSPORTS, "transports"),
        (plugins.ENGINES, "engine.options"),
    ):
        for name in plugins.available(group):
            kind = plugins.options_class(group, name)
            if kind is not None:
                out[f"{prefix}.{name}"] = kind
    return out


def render(text: str) -> str:
    """``text`` with every table rewritten; ValueError for a missing, repeated or unknown one."""
    want = tables()
    seen: list[str] = []

    def table(match: re.Match[str]) -> str:
        name = match.group(2)
        if name not in want:
            raise ValueError(f"docs/configuration.md has a table for {name!r}, which is no section")
        seen.append(name)
        return f"{match.group(1)}{markdown_table(want[name])}\n{match.group(4)}"

    out = BLOCK.sub(table, text)
    missing = sorted(set(want) - set(seen))
    repeated = sorted({n for n in seen if seen.count(n) > 1})
    if missing or repeated:
        raise ValueError(f"docs/configuration.md: tables missing {missing}, repeated {repeated}")
    return out


def main(argv: list[str]) -> int:
    text = DOC.read_text()
    fresh = render(text)
    if "--check" in argv:
        if fresh != text:
            print("docs/configuration.md: option tables are stale; run scripts/config_docs.py")
            return 1
        return 0
    DOC.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
