"""The runtime's generation part (``runtime.generations``): runs a
:class:`~sessiontape.core.generation.request.GenerateRequest` on a session.

It holds what every generation shares: the engine, the log, the session cache's port,
the admission and the priority gate (:mod:`~sessiontape.core.generation.scheduler`),
the run policy (:mod:`~sessiontape.core.generation.policy`), the running generations,
and the Kakeya invariant counters. One generation's life is
:mod:`~sessiontape.core.generation.lifecycle`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from sessiontape.core import metrics
from sessiontape.core.engine.interface import Engine
from sessiontape.core.events import Event
from sessiontape.core.generation.host import SessionPort
from sessiontape.core.generation.lifecycle import generate_runs
from sessiontape.core.generation.policy import RunPolicy
from sessiontape.core.generation.request import GenerateRequest
from sessiontape.core.generation.running import RunningGenerations
from sessiontape.core.generation.scheduler import Admission, PriorityGate
from sessiontape.core.log import EventLog


class Generations:
    """Generations on every session of one runtime (see the module docstring)."""

    def __init__(
        self,
        engine: Engine,
        log_: EventLog,
        sessions: SessionPort,
        running: RunningGenerations,
        policy: RunPolicy,
        admission: Admission,
    ) -> None:
        self.engine = engine
        self.log = log_
        self.sessions = sessions
        self.running = running
        self.policy = policy
        self.admission = admission
        self.gate = PriorityGate()
        #: Kakeya counters: session id -> [INV-1 violations, INV-2 violations]
        self.invariant_violations: dict[str, list[int]] = {}

    def runs(self, session_id: str, request: GenerateRequest) -> AsyncIterator[list[Event]]:
        """The generation's events in runs: each item is the events of one commit.

        The engine decodes ahead of the log (at most the policy's ``run_ahead`` steps)
        while runs commit; a transport that writes a whole run at once pays its
        per-message cost once per run (core/generation/pipeline.py). The request's
        ``with_run`` adds the caller's own events to each run's commit; with
        ``start_apart`` the first item is the committed ``generation.started`` (and any
        truncation), before the engine starts; otherwise they come in the first run.
        """
        return generate_runs(self, session_id, request)

    async def events(self, session_id: str, request: GenerateRequest) -> AsyncIterator[Event]:
        """Append (optionally), prefill and decode; yields each committed event.

        Yields ``tokens.truncated`` (a rewind, or sink+window at most once),
        ``generation.started``, ``generation.token`` per scored prompt position and per
        generated token, then ``generation.finished``. Every check happens before the
        first commit, which holds the append, any truncation and ``generation.started``
        together, with the first run of tokens unless ``start_apart``
        (core/generation/lifecycle.py). A second concurrent generation on the session
        raises SessionBusy. If the caller stops iterating, the generation is recorded
        as ``cancelled``; an engine failure as ``error`` with an ``error.recorded``
        event. Without a seed, one is drawn and recorded, so every generation can be
        re-executed. The same as :meth:`runs`, one event at a time.
        """
        runs = self.runs(session_id, request)
        try:
            async for run in runs:
                for e in run:
                    yield e
        finally:
            # abandoned without aclose, both generators are finalized by the loop at
            # once: the inner one may be closing already
            with contextlib.suppress(RuntimeError):
                await runs.aclose()  # type: ignore[attr-defined]

    def is_running(self, session_id: str) -> bool:
        """Whether a generation runs on the session now."""
        return session_id in self.running

    async def stop(self, session_id: str) -> None:
        """Stop the session's generation (finished as ``aborted``) and wait for its end."""
        await self.running.stop(session_id)

    def record_violation(self, session_id: str, which: int) -> None:
        """Count a Kakeya invariant violation (``which``: 1 or 2) of the session."""
        counts = self.invariant_violations.setdefault(session_id, [0, 0])
        counts[which - 1] += 1
        metrics.INVARIANT_VIOLATIONS.labels(f"INV-{which}").inc()
