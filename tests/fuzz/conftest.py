"""Fuzzing every wire with Hypothesis.

Each fuzz test exists twice: a seeded slice (``derandomize``, a few examples)
in the default run, and a long run marked ``fuzz`` that is skipped unless
asked for: ``pytest -m fuzz tests/fuzz`` (``SESSIONTAPE_FUZZ_EXAMPLES``
sets its size, default 300).
"""

from __future__ import annotations

import pytest

# the gRPC fuzz tests still import these from here (their rewrite imports tests.helpers.fuzz)
from tests.helpers.fuzz import LONG as LONG
from tests.helpers.fuzz import QUICK as QUICK
from tests.helpers.fuzz import LoggedErrors as LoggedErrors
from tests.helpers.fuzz import fuzz_settings as fuzz_settings


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "fuzz" in (config.getoption("markexpr", "") or ""):
        return
    skip = pytest.mark.skip(reason="the long fuzz run: pytest -m fuzz tests/fuzz")
    for item in items:
        if item.get_closest_marker("fuzz") is not None:
            item.add_marker(skip)
