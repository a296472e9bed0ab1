"""Hypothesis settings for the fuzz tests (a seeded slice by default, a long run under ``-m fuzz``) and a collector of what a server logs at ERROR."""

from __future__ import annotations

import logging
import os

from hypothesis import HealthCheck, settings

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


class LoggedErrors(logging.Handler):
    """Collects what a server logs at ERROR (an internal error's traceback), for a fuzz
    failure's report and for the assertion that nothing was."""

    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.ERROR)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(self.format(record))
