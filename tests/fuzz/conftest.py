"""Fuzzing every wire with Hypothesis.

Each fuzz test exists twice: a seeded slice (``derandomize``, a few examples)
in the default run, and a long run marked ``fuzz`` that is skipped unless
asked for: ``pytest -m fuzz tests/fuzz`` (``SESSIONTAPE_FUZZ_EXAMPLES``
sets its size, default 300).
"""

from __future__ import annotations

import logging
import os

import pytest
from hypothesis import HealthCheck, settings

from tests.transports.nostr.conftest import local_relay, make_worker  # noqa: F401 - the D4 fuzz's fixtures

#: examples per test in the default run, and in the ``-m fuzz`` run
QUICK = 12
LONG = int(os.environ.get("SESSIONTAPE_FUZZ_EXAMPLES", "300"))


def fuzz_settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
        ],
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "fuzz" in (config.getoption("markexpr", "") or ""):
        return
    skip = pytest.mark.skip(reason="the long fuzz run: pytest -m fuzz tests/fuzz")
    for item in items:
        if item.get_closest_marker("fuzz") is not None:
            item.add_marker(skip)


class LoggedErrors(logging.Handler):
    """Collects what a server logs at ERROR (an internal error's traceback), for a fuzz
    failure's report and for the assertion that nothing was."""

    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.ERROR)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(self.format(record))
