"""The run policy on its own (core/generation/policy.py): pure decisions from given
times and counts, no engine, log or clock."""

from __future__ import annotations

import pytest

from sessiontape.core.config import GenerationSettings
from sessiontape.core.generation.policy import (
    FIRST_RUN,
    PACE_S,
    SHORT_GENERATION,
    SHORT_HOLD_S,
    RunPolicy,
    ShortHold,
    moving_average,
)


def test_the_settings_derive_the_rest_of_the_policy() -> None:
    p = RunPolicy.from_settings(GenerationSettings(max_run=100, linger_s=0.02, max_active=3))
    assert (p.max_run, p.run_ahead, p.min_run, p.burst) == (100, 100, 25, 25)
    assert (p.linger_s, p.burst_s, p.pace_s) == (0.02, 0.02, PACE_S)
    # the defaults describe the policy's own defaults
    assert RunPolicy.from_settings(GenerationSettings()) == RunPolicy()
    # a run of one step still lingers for one
    assert RunPolicy.from_settings(GenerationSettings(max_run=1)).min_run == 1


@pytest.mark.parametrize(
    ("interval", "missing", "wait"),
    [
        (0.0001, 10, 0.002),  # fast: twice the pace for the missing steps
        (0.0001, 1000, 0.005),  # ... at most linger_s
        (0.00125, 10, 0.0),  # a step every quarter of linger_s: no longer fast
        (0.01, 1, 0.0),  # slow: its steps commit as they come
    ],
)
def test_a_committer_lingers_for_a_fast_engine_only(
    interval: float, missing: int, wait: float
) -> None:
    assert RunPolicy().linger(interval, missing, None, False, now=0.0) == pytest.approx(wait)


def test_a_short_generation_holding_the_gate_lingers_to_the_end_of_its_hold() -> None:
    p = RunPolicy()
    hold = ShortHold(SHORT_GENERATION)
    assert p.linger(0.01, 4, hold, True, now=5.0) == 0.0  # its hold has not begun
    hold.begin(5.0)
    hold.begin(6.0)  # a later turn does not move the hold
    assert hold.until == pytest.approx(5.0 + SHORT_HOLD_S)
    # a slow engine by the linger rule, but the hold keeps its first run waiting
    assert p.linger(0.01, 4, hold, True, now=5.01) == pytest.approx(SHORT_HOLD_S - 0.01)
    assert p.linger(0.01, 4, hold, False, now=5.01) == 0.0  # nobody waits: no reason
    assert p.linger(0.01, 4, hold, True, now=5.0 + SHORT_HOLD_S) == 0.0  # over


def test_a_short_hold_ends_when_the_engines_pace_says_the_rest_comes_too_late() -> None:
    hold = ShortHold(10)
    hold.begin(0.0)
    hold.decoded_one(0.03)  # the first carries the prefill: no pace yet
    assert hold.decode_s is None and hold.holds(0.01)
    hold.decoded_one(0.001)
    assert hold.decode_s == 0.001 and hold.holds(0.01)  # 8 more at 1 ms: in time
    hold.decoded_one(0.02)  # the pace slows (an average, weighted to the newest)
    assert hold.decode_s == pytest.approx(0.0105)
    assert not hold.holds(0.01)  # 7 more at 10.5 ms pass the hold's end
    assert hold.left_s(0.01) == pytest.approx(SHORT_HOLD_S - 0.01)
    assert ShortHold(3).left_s(1.0) == 0.0


def test_runs_are_cut_for_a_paced_caller_and_before_its_pace_is_known() -> None:
    p = RunPolicy(max_run=256, min_run=64, pace_s=0.004)
    # a caller's pace unknown: the first run is short, unless the engine is done
    assert p.run_bounds(None, False, FIRST_RUN) == (FIRST_RUN, FIRST_RUN)
    assert p.run_bounds(None, True, FIRST_RUN) == (256, 64)
    # a fast caller: full runs
    assert p.paced_run(0.000001) is None
    assert p.run_bounds(0.000001, False, FIRST_RUN) == (256, 64)
    # a caller taking 1 ms an event: runs of 4 (about pace_s)
    assert p.paced_run(0.001) == 4
    assert p.run_bounds(0.001, False, FIRST_RUN) == (4, 4)
    # a very slow one still gets a step a run
    assert p.paced_run(1.0) == 1


def test_a_short_generations_first_run_waits_for_its_end() -> None:
    p = RunPolicy()
    assert p.first_run(SHORT_GENERATION) == SHORT_GENERATION + 1
    assert p.first_run(3) == FIRST_RUN
    assert p.first_run(SHORT_GENERATION + 1) == FIRST_RUN


def test_a_turn_ends_past_its_time_while_another_waits_unless_a_short_hold_keeps_it() -> None:
    p = RunPolicy()
    assert not p.turn_over(1.0, 2.0, True, None)  # within the turn
    assert not p.turn_over(3.0, 2.0, False, None)  # past it, nobody waits
    assert p.turn_over(3.0, 2.0, True, None)
    hold = ShortHold(4)
    hold.begin(2.99)
    assert not p.turn_over(3.0, 2.0, True, hold)
    assert p.turn_over(3.0 + SHORT_HOLD_S, 2.0, True, hold)


def test_a_moving_average_starts_at_its_first_sample() -> None:
    assert moving_average(None, 3.0, 0.2) == 3.0
    assert moving_average(1.0, 3.0, 0.2) == pytest.approx(1.4)
    assert moving_average(1.0, 3.0, 1.0) == 3.0


def test_a_committer_commits_at_once_when_enough_are_ready_or_no_more_come_soon() -> None:
    p = RunPolicy(min_run=64)
    fast = {"interval": 0.0001, "short": None, "others_waiting": False, "now": 0.0}
    assert p.commit_wait(ready=10, min_run=64, more_soon=True, **fast) == pytest.approx(0.005)
    assert p.commit_wait(ready=60, min_run=64, more_soon=True, **fast) == pytest.approx(0.0008)
    assert p.commit_wait(ready=64, min_run=64, more_soon=True, **fast) == 0.0
    assert p.commit_wait(ready=10, min_run=64, more_soon=False, **fast) == 0.0
    assert p.commit_wait(ready=1, min_run=1, more_soon=True, **fast) == 0.0
    unknown = {**fast, "interval": None}
    assert p.commit_wait(ready=1, min_run=64, more_soon=True, **unknown) == 0.0
