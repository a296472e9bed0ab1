"""What a generation needs of the runtime, as Protocols (the generation package names
no runtime class, so nothing here imports the runtime back).

:class:`SessionPort` is the session cache's side (:class:`sessiontape.core.session.cache.SessionStates`
implements it); :class:`GenerationHost` is everything a generation uses
(:class:`sessiontape.core.generation.generations.Generations` implements it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from sessiontape.core.events import Event, NewEvent
from sessiontape.core.session.state import SessionState

if TYPE_CHECKING:
    from sessiontape.core.engine.interface import Engine
    from sessiontape.core.generation.policy import RunPolicy
    from sessiontape.core.generation.running import RunningGenerations
    from sessiontape.core.generation.scheduler import Admission, PriorityGate
    from sessiontape.core.log import EventLog


class SessionPort(Protocol):
    """What a generation needs of the session cache: the session's lock, its open
    state, a commit that folds what it appends, and dropping a state another process
    moved on."""

    def lock(self, sid: str) -> asyncio.Lock: ...

    async def open_locked(self, session_id: str) -> SessionState: ...

    async def commit(
        self,
        st: SessionState,
        new: Sequence[NewEvent],
        *,
        length: int | None = None,
        at_once: bool = True,
    ) -> list[Event]: ...

    def drop(self, st: SessionState) -> None: ...


class GenerationHost(Protocol):
    """What a generation needs: the engine, the log, the session cache's port, the
    admission and the priority gate, the run policy, the running generations, and a
    place to count invariant violations."""

    @property
    def engine(self) -> Engine: ...

    @property
    def log(self) -> EventLog: ...

    @property
    def sessions(self) -> SessionPort: ...

    @property
    def gate(self) -> PriorityGate: ...

    @property
    def admission(self) -> Admission: ...

    @property
    def policy(self) -> RunPolicy: ...

    @property
    def running(self) -> RunningGenerations: ...

    def record_violation(self, session_id: str, which: int) -> None: ...
