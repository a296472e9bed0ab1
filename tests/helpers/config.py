"""What every test asks for: a configuration over a database, a free loopback port, the PostgreSQL server the suite may use."""

from __future__ import annotations

import os
import socket

import pytest

from sessiontape.core.config import Config

PG_HOST = os.environ.get("SESSIONTAPE_TEST_PG_HOST", "127.0.0.1")


PG_PORT = int(os.environ.get("SESSIONTAPE_TEST_PG_PORT", "5432"))


PG_DB = os.environ.get("SESSIONTAPE_TEST_PG_DB", "test")


PG_USER = os.environ.get("SESSIONTAPE_TEST_PG_USER", "postgres")


def _pg_up() -> bool:
    try:
        with socket.create_connection((PG_HOST, PG_PORT), timeout=1):
            return True
    except OSError:
        return False


PG_AVAILABLE = _pg_up()


#: CI sets SESSIONTAPE_REQUIRE_PG=1: there a missing server fails the run instead of skipping.
PG_REQUIRED = os.environ.get("SESSIONTAPE_REQUIRE_PG") == "1"


requires_pg = pytest.mark.skipif(
    not PG_AVAILABLE and not PG_REQUIRED, reason=f"no PostgreSQL at {PG_HOST}:{PG_PORT}"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_config(url: str, **overrides: object) -> Config:
    data: dict[str, object] = {"database": {"url": url}, "engine": {"name": "reference"}}
    data.update(overrides)
    return Config.load(environ={}, overrides=data)
