"""Runtimes as tests watch them: the commits a runtime makes, an engine that counts its calls."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from sessiontape.core.engine.interface import DEFAULT_OUTPUT, OutputOptions, SamplingParams, Step
from sessiontape.core.errors import EngineError
from sessiontape.core.events import Event, NewEvent
from sessiontape.core.runtime import Runtime
from sessiontape.engines.reference import ReferenceEngine


class SpyEngine(ReferenceEngine):
    """The reference engine, noting the history each generation starts on; its first
    step can be held back (``hold``) or fail (``fail``)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.histories: list[list[int]] = []
        self.hold: asyncio.Event | None = None
        self.fail = False

    async def generate(
        self,
        session_key: str,
        history: Sequence[int],
        params: SamplingParams,
        options: OutputOptions = DEFAULT_OUTPUT,
    ) -> AsyncIterator[Step]:
        self.histories.append(list(history))
        if self.hold is not None:
            await self.hold.wait()
        if self.fail:
            raise EngineError("the device fell over")
        async for step in super().generate(session_key, history, params, options):
            yield step


def spy_commits(rt: Runtime) -> list[list[str]]:
    """The event types of each commit the runtime makes from now on."""
    commits: list[list[str]] = []
    commit = rt.sessions.commit

    async def spied(st: Any, new: Sequence[NewEvent], **kw: Any) -> list[Event]:
        evs = await commit(st, new, **kw)
        commits.append([e.type for e in evs])
        return evs

    rt.sessions.commit = spied  # type: ignore[method-assign]
    return commits
