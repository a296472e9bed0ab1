"""Fixtures of the core tests: a database with sessions in every state the CLI lists."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from sessiontape.core.engine.interface import OutputOptions, SamplingParams
from sessiontape.core.generation.request import GenerateRequest
from sessiontape.core.nodes import FragmentIn
from sessiontape.core.runtime import Runtime
from sessiontape.engines.reference import ReferenceEngine
from tests.helpers.config import make_config


@pytest.fixture
def populated(tmp_path: Path) -> tuple[str, list[str]]:
    url = f"sqlite+aiosqlite:///{tmp_path / 'cli.db'}"

    async def build() -> list[str]:
        rt = await Runtime.create(make_config(url), engine=ReferenceEngine())
        try:
            a = (await rt.open_session("http", label="demo")).session_id
            await rt.append_text(a, "Hi there")
            async for _ in rt.generate(
                a,
                GenerateRequest(
                    SamplingParams(max_tokens=6, seed=7), OutputOptions(logprob_top_k=2)
                ),
            ):
                pass
            await rt.record_feedback(a, {"score": 8, "source": "test"})
            b = (await rt.fork(a, at_position=4)).session_id
            async for _ in rt.generate(
                b, GenerateRequest(SamplingParams(max_tokens=3, temperature=0))
            ):
                pass
            c = (await rt.open_session("evergreen")).session_id
            await rt.nodes.append_fragments(
                c,
                [
                    FragmentIn(
                        id="n",
                        has_chunk=True,
                        data=b"\x00" * 9000,
                        metadata={"mimetype": "application/octet-stream"},
                    )
                ],
            )
            await rt.close(a)
            return [a, b, c]
        finally:
            await rt.aclose()

    return url, asyncio.run(build())
