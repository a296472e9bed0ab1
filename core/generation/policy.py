"""The run policy: how many engine steps a generation's run holds, how long its committer
lingers for more, and how long a turn of the priority gate lasts (docs/architecture.md,
"Pacing").

:class:`RunPolicy` is pure: no I/O and no clock of its own; the token pipeline
(:mod:`sessiontape.core.generation.pipeline`) hands it the times and counts it measured
and acts on what it answers. Three ``[generation]`` settings feed it (``max_run``,
``linger_s``, ``max_active``: :class:`sessiontape.core.config.GenerationSettings`); the
rest is derived from them or constant, each constant with its reason below.

A fast engine's committer lingers a little for more steps, so one append carries many:
twice the engine's pace for the steps still missing, at most ``linger_s``. A slower
engine's steps commit as they come.

Generations of equal priority take turns at the gate, each turn ending after
``burst_s`` once another waits. Under load the event loop's other work runs between
every two engine steps, so a fast engine's 16 steps take longer than ``burst_s``;
handed over part-way, such a generation would commit what it had and wait behind every
other generation's turn for a second run and a second commit. A short generation (at
most :data:`SHORT_GENERATION` tokens) therefore keeps the gate to its end, and its first
run waits for that end, while its engine's pace says the rest is made within
:data:`SHORT_HOLD_S` of its first turn (:class:`ShortHold`). A slow engine's short
generation takes turns as before, so a slow model's sessions still see their tokens as
they come.
"""

from __future__ import annotations

import dataclasses

from sessiontape.core.config import GenerationSettings

#: most steps in a generation's first run, committed before the caller's pace is known:
#: a slow caller's first tokens do not wait behind a full run
FIRST_RUN = 8

#: a generation of at most this many tokens (a short turn) is not cut at ``FIRST_RUN``:
#: a fast engine makes the rest in about the time the first run's tokens take to write,
#: and one run is one commit and one hand-over fewer (the engine worker's child sends
#: it in one batch too: core/engine/child.py)
SHORT_GENERATION = 2 * FIRST_RUN

#: the longest a short generation holds the gate past ``burst_s`` (counted from its
#: first turn, not from its wait for it): about one commit's worth of other sessions' wait
SHORT_HOLD_S = 0.05

#: a caller slower than the engine gets runs it handles in about this long: short enough
#: that a run's last token is not held long behind its first, long enough for a few tokens
PACE_S = 0.004

#: the committer lingers for ``min_run`` steps, this fraction of ``max_run``: a run big
#: enough to pay one commit for many steps, small enough to fill within ``linger_s``
MIN_RUN_FRACTION = 4

#: an engine lingered for makes a step at least this many times per ``linger_s``; a
#: slower one's steps commit as they come (lingering would only delay them)
FAST_STEPS_PER_LINGER = 4

#: the weight of the newest sample in the engine's step interval: steady enough that one
#: slow step (a commit on the loop) does not make a fast engine look slow
INTERVAL_NEW_WEIGHT = 0.2

#: the weight of the newest sample in the caller's time per event: weighted to the latest
#: run, since a caller's first messages are slow (a new stream) and forgetting them slowly
#: kept the runs after a short first run small for a dozen runs
CONSUME_NEW_WEIGHT = 0.7

#: the weight of the newest sample in a short generation's decode pace
DECODE_NEW_WEIGHT = 0.5


def moving_average(previous: float | None, sample: float, new_weight: float) -> float:
    """``sample`` weighted by ``new_weight`` against ``previous`` (the sample itself first)."""
    if previous is None:
        return sample
    return (1.0 - new_weight) * previous + new_weight * sample


class ShortHold:
    """One short generation's hold of the gate: its steps so far and its engine's pace
    (times are given, never read)."""

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
            self.decode_s = moving_average(self.decode_s, took_s, DECODE_NEW_WEIGHT)

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


@dataclasses.dataclass(frozen=True)
class RunPolicy:
    """How a generation's steps are cut into runs and turns (see the module docstring).

    Built from the ``[generation]`` settings by :meth:`from_settings`; tests build one
    directly to pin a value the settings derive."""

    #: most steps committed in one append
    max_run: int = 256
    #: the longest a committer waits for more steps of a fast engine
    linger_s: float = 0.005
    #: decoded steps that may wait uncommitted (a full queue pauses the engine)
    run_ahead: int = 256
    #: the committer lingers until this many steps are ready
    min_run: int = 64
    #: engine steps a generation takes in one turn of the priority gate
    burst: int = 64
    #: a turn ends past this many seconds while another generation waits
    burst_s: float = 0.005
    #: a slow caller gets runs it handles in about this long
    pace_s: float = PACE_S

    @classmethod
    def from_settings(cls, settings: GenerationSettings) -> RunPolicy:
        """The policy the settings describe: the queue holds one full run beyond the one
        committing (``run_ahead = max_run``); the committer lingers for a quarter of a run
        (``min_run``), which one turn of the gate fills (``burst = min_run``); a turn
        lasts as long as a linger (``burst_s = linger_s``)."""
        min_run = max(1, settings.max_run // MIN_RUN_FRACTION)
        return cls(
            max_run=settings.max_run,
            linger_s=settings.linger_s,
            run_ahead=settings.max_run,
            min_run=min_run,
            burst=min_run,
            burst_s=settings.linger_s,
        )

    def first_run(self, max_tokens: int) -> int:
        """Most steps in the first run of a generation of ``max_tokens`` tokens: a short
        generation's first run waits for the engine's end too (one more than its steps),
        so the finish rides with it."""
        if max_tokens <= SHORT_GENERATION:
            return max(FIRST_RUN, max_tokens + 1)
        return FIRST_RUN

    def paced_run(self, consume_per_event: float | None) -> int | None:
        """The run a caller taking ``consume_per_event`` seconds per event handles in about
        ``pace_s``; None when the caller is not paced (its pace is unknown, or it handles a
        full ``max_run`` within that)."""
        c = consume_per_event
        if c is None or c * self.max_run <= self.pace_s:
            return None
        return max(1, int(self.pace_s / c))

    def run_bounds(
        self, consume_per_event: float | None, engine_done: bool, first_run: int
    ) -> tuple[int, int]:
        """``(max_run, min_run)`` for the next run: cut to a paced caller's pace; before the
        caller's pace is known (the first run) at most ``first_run``, unless the engine is
        done already (a short answer commits all it made at once)."""
        max_run, min_run = self.max_run, self.min_run
        paced = self.paced_run(consume_per_event)
        if paced is not None:
            max_run = paced
        elif consume_per_event is None and not engine_done:
            max_run = min(max_run, first_run)
        return max_run, min(min_run, max_run)

    def commit_wait(
        self,
        *,
        ready: int,
        min_run: int,
        interval: float | None,
        more_soon: bool,
        short: ShortHold | None,
        others_waiting: bool,
        now: float,
    ) -> float:
        """How long a committer holding ``ready`` steps waits for ``min_run`` (0: commit
        now): not when enough are ready, the engine's pace is unknown (one step so far),
        or no more step comes soon (the engine ended, or handed the gate over); else
        :meth:`linger`."""
        if min_run <= 1 or ready >= min_run or interval is None or not more_soon:
            return 0.0
        return self.linger(interval, min_run - ready, short, others_waiting, now)

    def linger(
        self,
        interval: float,
        missing: int,
        short: ShortHold | None,
        others_waiting: bool,
        now: float,
    ) -> float:
        """How long a committer waits, at ``now``, for ``missing`` more steps of an engine
        making one every ``interval`` seconds (0: not at all). A short generation holding
        the gate to its end while others wait for it waits for that end (or a hand-over),
        however long the loop's other work stretched its steps."""
        wait = 0.0
        if interval * FAST_STEPS_PER_LINGER < self.linger_s:
            wait = min(self.linger_s, 2 * interval * missing)
        if short is not None and others_waiting and short.holds(now):
            wait = max(wait, short.left_s(now))
        return wait

    def turn_over(
        self, now: float, turn_ends: float, others_waiting: bool, short: ShortHold | None
    ) -> bool:
        """Whether a turn of the gate that ends at ``turn_ends`` is over at ``now``: past
        its end while another generation waits, unless a short generation holds it."""
        return now >= turn_ends and others_waiting and not (short is not None and short.holds(now))
