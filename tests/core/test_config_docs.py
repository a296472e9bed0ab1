"""docs/configuration.md and sessiontape.example.toml against the settings classes: the
page's option tables are what scripts/config_docs.py makes from the classes (names, types,
defaults, bounds), every section has one, and the example names no option that is not."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from sessiontape.core.config import GenerationSettings, LimitsSettings
from sessiontape.core.settings_framework import markdown_table
from sessiontape.engines.onnx.options import OnnxOptions
from sessiontape.transports.grpc.settings import GrpcSettings

REPO = Path(__file__).resolve().parents[2]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "config_docs", REPO / "scripts" / "config_docs.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tables_are_what_the_classes_make() -> None:
    docs = _script()
    text = docs.DOC.read_text()
    assert docs.render(text) == text, "run .venv/bin/python scripts/config_docs.py"
    assert docs.main(["--check"]) == 0


def test_every_section_engine_and_transport_has_a_table() -> None:
    names = set(_script().tables())
    assert {
        "database",
        "engine",
        "generation",
        "limits",
        "engine.options.onnx",
        "engine.options.reference",
        "transports.grpc",
        "transports.http",
        "transports.nostr",
    } <= names
    assert _script().tables()["engine.options.onnx"] is OnnxOptions


def test_a_stale_missing_or_unknown_table_is_caught() -> None:
    docs = _script()
    text = docs.DOC.read_text()
    stale = text.replace("| `max_run` | integer | `256` |", "| `max_run` | integer | `128` |")
    assert stale != text and docs.render(stale) == text  # rewritten to the class's default
    block = re.compile(r"<!-- options: generation -->\n.*?<!-- /options -->\n", re.DOTALL)
    with pytest.raises(ValueError, match="missing \\['generation'\\]"):
        docs.render(block.sub("", text))
    with pytest.raises(ValueError, match="'sever'"):
        docs.render(text + "\n<!-- options: sever -->\n<!-- /options -->\n")


def test_a_table_row_says_name_type_default_bounds_and_meaning() -> None:
    table = markdown_table(GenerationSettings).splitlines()
    assert table[0] == "| option | type | default | accepts | meaning |"
    assert [row.split("|")[1].strip() for row in table[2:]] == [
        f"`{f.name}`" for f in dataclasses.fields(GenerationSettings)
    ]
    assert "| `linger_s` | number | `0.005` | > 0 |" in markdown_table(GenerationSettings)
    assert "| `max_body_bytes` | integer | `16777216` | >= 1 |" in markdown_table(LimitsSettings)
    grpc = markdown_table(GrpcSettings)
    assert "| `tls_cert` | string | unset |" in grpc
    assert "| `max_message_bytes` | integer | `4194304` | >= 1 |" in grpc


def _example_tables() -> dict[str, set[str]]:
    """Each table of the example file -> the keys it sets or shows commented out."""
    out: dict[str, set[str]] = {}
    table = ""
    for line in (REPO / "sessiontape.example.toml").read_text().splitlines():
        header = re.match(r"\s*\[([\w.]+)\]", line)
        if header:
            table = header.group(1)
            out.setdefault(table, set())
            continue
        key = re.match(r"#?\s*(\w+)\s*=\s*\S", line)
        if key and table:
            out[table].add(key.group(1))
    return out


def test_the_example_names_only_known_options() -> None:
    want: dict[str, type[Any]] = _script().tables()
    want["engine.options"] = want["engine.options.onnx"]  # the example's engine
    seen = _example_tables()
    assert {"database", "engine.options", "transports.grpc", "generation"} <= set(seen)
    for table, keys in seen.items():
        if table == "sessions.idle_ttl_s":  # protocol names: any
            continue
        known = {f.name for f in dataclasses.fields(want[table])}
        assert keys <= known, f"[{table}] names {sorted(keys - known)}"
