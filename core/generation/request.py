"""What a generation is asked to do: the request as every wire gives it, the hook a
transport adds its own events to each run with, and the generation's first append.

``runtime.generations.runs`` (:mod:`sessiontape.core.generation.generations`) and
``Runtime.generate`` take a :class:`GenerateRequest`; the token pipeline
(:mod:`sessiontape.core.generation.pipeline`) runs it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from sessiontape.core.engine.interface import DEFAULT_OUTPUT, OutputOptions, SamplingParams
from sessiontape.core.events import Event, NewEvent
from sessiontape.core.session.state import SessionState
from sessiontape.core.tokens import ImageIn

#: ``with_run(state, tokens, last) -> events``: called under the session's lock just
#: before each run of generated tokens commits (and before the last run, which may hold
#: none), with the session's state (the run not yet in it), the run's generated token
#: ids, and whether the run is the generation's last (it carries ``generation.finished``); the events it returns commit in the same
#: append, after the run's tokens and before the finish (a transport's record of what it
#: sends for the run, such as Evergreen's output fragment, the final one with the last
#: run). When a generation that ended on its own commits its finish apart from its last
#: run, the hook is called once more, with no tokens and ``last`` true, and its events
#: commit with that finish. It must not await; if it raises, the run is not committed
#: and the generation fails with that error.
RunHook = Callable[[SessionState, list[int], bool], Sequence[NewEvent]]


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """One generation's parameters, from the wire to the engine: what to append first
    (tokens, images, at an offset), how to sample, what to report, how urgent it is,
    the action it serves, the sink+window truncation, and a transport's run hook."""

    params: SamplingParams
    options: OutputOptions = DEFAULT_OUTPUT
    append: Sequence[int] = ()
    #: Salience's offset rule for ``append`` (None: append at the end)
    offset: int | None = None
    truncating: bool = False
    images: Sequence[ImageIn] = ()
    priority: int = 0
    action_id: str | None = None
    #: Kakeya's sink+window truncation (sink, window), applied before the generation
    sink_window: tuple[int, int] | None = None
    with_run: RunHook | None = None
    #: commit the first append (``generation.started``) on its own before the engine
    #: starts, not with the first run (:mod:`sessiontape.core.generation.lifecycle`)
    start_apart: bool = False

    @property
    def appends(self) -> bool:
        return bool(self.append or self.images or self.offset is not None)


@dataclasses.dataclass(frozen=True)
class FirstAppend:
    """A generation's first append (the request's tokens and images, any truncation
    and ``generation.started``): ``committed`` already, or ``pending``, to commit with
    the first run (or with the generation's end when no run commits)."""

    #: the history's length after it: the generation's prompt
    length: int
    committed: list[Event] = dataclasses.field(default_factory=list)
    pending: list[NewEvent] = dataclasses.field(default_factory=list)
