"""How long a generation's committer waits for more steps, and a short generation's
turn of the priority gate (docs/architecture.md, "Pacing").

A fast engine's committer lingers a little for more steps, so one append carries many:
twice the engine's pace for the steps still missing, at most ``[generation] linger_s``
(the loop's other work stretches its steps, and a timer that ran out a few steps short
would split a turn in two). A slower engine's steps commit as they come.

Generations of equal priority take turns at the gate (``core/scheduler.PriorityGate``),
each turn ending after ``[generation] burst_s`` once another waits. Under load the
event loop's other work (other calls, commits, messages) runs between every two engine
steps, so a fast engine's 16 steps take longer than ``burst_s``. Handed over part-way,
such a generation would commit what it had, and the rest would wait behind every other
generation's turn for a second run and a second commit: a turn's latency would then
depend on how many others are queued, and the fleet's tail would grow with it.

A short generation (at most :data:`SHORT_GENERATION` tokens) keeps the gate
to its end instead, and its first run waits for that end, while its engine's own pace
(the time per decoded step after the first, which also carries the prefill) says the
rest is made within :data:`SHORT_HOLD_S` of its first turn. The total work is the same;
the turns finish one after another instead of all together at the end, in one commit
each. A slow engine's short generation (one that would hold the gate longer) takes
turns as before, so a slow model's sessions still see their tokens as they come
(docs/architecture.md, "Pacing").
"""

from __future__ import annotations

import time

from sessiontape.core.config import GenerationSettings

#: most steps in a generation's first run, committed before the caller's pace is known
FIRST_RUN = 8

#: a generation of at most this many tokens (a short turn) is not cut at ``FIRST_RUN``:
#: a fast engine makes the rest in about the time the first run's tokens take to write,
#: and one run is one commit and one hand-over fewer (the engine worker's child sends
#: it in one batch too: core/engine/child.py)
SHORT_GENERATION = 2 * FIRST_RUN

#: the longest a short generation holds the gate past ``burst_s`` (counted from its
#: first turn, not from its wait for it), and its first run waits for its end
SHORT_HOLD_S = 0.05


class ShortHold:
    """One short generation's hold: its steps so far and its engine's pace."""

    __slots__ = ("decode_s", "decoded", "steps", "until")

    def __init__(self, steps: int) -> None:
        #: the generation's steps to decode
        self.steps = steps
        #: when the hold ends (None before the generation's first turn of the gate)
        self.until: float | None = None
        #: decoded (not prefill) steps so far
        self.decoded = 0
        #: time per decoded step after the first (a moving average; None before the second)
        self.decode_s: float | None = None

    def begin(self, now: float) -> None:
        """The generation holds the gate (the first time: the hold starts)."""
        if self.until is None:
            self.until = now + SHORT_HOLD_S

    def decoded_one(self, took_s: float) -> None:
        """A decoded step came, ``took_s`` after the one before it (or the turn's start)."""
        self.decoded += 1
        if self.decoded > 1:  # the first also carries the prefill
            d = self.decode_s
            self.decode_s = took_s if d is None else 0.5 * (d + took_s)

    def holds(self, now: float) -> bool:
        """Whether the generation keeps the gate (and its first run waits) for its end:
        by its engine's pace so far the rest is made before the hold ends."""
        until = self.until
        if until is None or now >= until:
            return False
        left = max(1, self.steps - self.decoded)
        return self.decode_s is None or now + self.decode_s * left <= until

    def left_s(self, now: float) -> float:
        """Seconds until the hold ends (0 when it has not begun or is over)."""
        return 0.0 if self.until is None else max(0.0, self.until - now)


def linger_s(
    limits: GenerationSettings,
    interval: float,
    missing: int,
    short: ShortHold | None,
    others_waiting: bool,
) -> float:
    """How long a committer waits for ``missing`` more steps of an engine making one every
    ``interval`` seconds (0: not at all). A short generation holding the gate to its end
    while others wait for it waits for that end (or a hand-over), however long the
    loop's other work stretched its steps."""
    wait = 0.0
    if interval * 4 < limits.linger_s:
        wait = min(limits.linger_s, 2 * interval * missing)
    if short is not None and others_waiting:
        now = time.perf_counter()
        if short.holds(now):
            wait = max(wait, short.left_s(now))
    return wait
