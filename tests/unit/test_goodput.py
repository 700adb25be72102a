"""Goodput from the nodes' notes (core/goodput.py): a restart's cost is last step before it -> first step after
it; the ratio is the time since the first step less those costs over the time since the first step; steps redone
after a restore are counted when the workers say which step they resumed from. Slow nodes (core/slow.py)."""
from __future__ import annotations

import pytest

from protocol.notes import PACE_MIN_STEPS, ProgressNote
from rdzv_server.core.goodput import MAX_RATE_POINTS, JobProgress, note, round_formed
from rdzv_server.core.slow import SLOW_STEPS, Paces


def n(round_id: int, steps: int, first: float, last: float, *, window_s: float = 2.0, window_steps: int = 4,
      resumed: int = -1, demand: float = 0.5) -> ProgressNote:
    return ProgressNote(round_id=round_id, probes=2, steps=steps, first_step_at=first, last_step_at=last,
                        step_s=0.5, window_s=window_s, window_steps=window_steps, demand=demand, resumed_step=resumed)


def test_a_crash_costs_last_step_before_to_first_step_after_and_the_ratio_counts_it() -> None:
    p = JobProgress()
    round_formed(p, 1, "start")
    assert p.ratio(50.0, running=True) is None              # not stepped yet
    note(p, "a", n(1, 10, 100.0, 110.0), 1, 110.0)
    note(p, "b", n(1, 12, 100.5, 112.0), 1, 112.0)
    assert (p.first_step_at, p.last_step_at, p.steps) == (100.0, 112.0, 12)
    round_formed(p, 2, "failure")                           # the crash
    assert p.pending is not None and p.pending.last_step_at == 112.0
    assert p.ratio(120.0, running=True) == pytest.approx((20.0 - 8.0) / 20.0)   # the restart so far counts
    note(p, "a", n(1, 14, 100.0, 115.0), 2, 121.0)          # a late note of the old round: dropped
    note(p, "a", n(2, 0, 0.0, 0.0), 2, 121.0)               # the new round, not stepped yet
    note(p, "a", n(2, 3, 122.0, 123.0), 2, 123.0)
    assert p.pending is None and p.costs[0].cost_s == pytest.approx(10.0) and p.restarts == 1
    assert (p.steps, p.lost_s) == (15, pytest.approx(10.0))
    assert p.ratio(132.0, running=True) == pytest.approx((32.0 - 10.0) / 32.0)
    assert p.ratio(500.0, running=False) == pytest.approx((23.0 - 10.0) / 23.0)   # ended: up to its last step


def test_steps_redone_after_a_restore_are_counted() -> None:
    p = JobProgress()
    round_formed(p, 1, "start")
    note(p, "a", n(1, 40, 100.0, 140.0), 1, 140.0)          # reached step 40 from scratch
    round_formed(p, 2, "failure")
    note(p, "a", n(2, 0, 0.0, 0.0, resumed=30), 2, 150.0)   # snapshot of step 30 loaded
    note(p, "a", n(2, 5, 151.0, 155.0, resumed=30), 2, 155.0)
    assert p.costs[0].redone == 10 and p.redone == 10
    round_formed(p, 3, "node_lost")
    note(p, "a", n(3, 1, 160.0, 160.0, resumed=34), 3, 160.0)    # reached 35, resumed from 34
    assert p.costs[1].redone == 1 and p.redone == 11


def test_steps_per_second_and_the_picture_stay_bounded() -> None:
    p = JobProgress()
    round_formed(p, 1, "start")
    for i in range(3 * MAX_RATE_POINTS):
        note(p, "a", n(1, i + 1, 100.0, 100.0 + i, window_s=2.0, window_steps=4), 1, 100.0 + 10.0 * i)
    assert p.steps_per_s() == 2.0
    assert len(p.rate_points) <= MAX_RATE_POINTS and p.rate_every_s > 10.0


def test_a_node_the_others_wait_on_is_named_slow_after_enough_steps_and_cleared_after_as_many() -> None:
    paces = Paces()
    changes = []
    for i in range(8):           # b computes all the time; a waits two thirds of each step
        paces.note("a", n(1, i, 0, 0, window_steps=5, demand=0.33), 5.0 * i)     # a note every 5 s
        changes.append(paces.note("b", n(1, i, 0, 0, window_steps=5, demand=0.98), 5.0 * i))
    named_at = changes.index(True)
    assert (named_at + 1) * 5 >= SLOW_STEPS and paces.slow() == ["b"] and changes.count(True) == 1
    for i in range(8, 16):
        paces.note("a", n(1, i, 0, 0, window_steps=5, demand=0.9), 5.0 * i)
        changes.append(paces.note("b", n(1, i, 0, 0, window_steps=5, demand=0.95), 5.0 * i))
    assert changes.count(False) == 1 and paces.slow() == []


def test_nodes_at_the_same_pace_are_never_named() -> None:
    paces = Paces()
    for i in range(100):
        jitter = 0.15 if i % 2 else -0.15
        assert paces.note("a", n(1, i, 0, 0, demand=0.6 + jitter), float(i)) is None
        assert paces.note("b", n(1, i, 0, 0, demand=0.6 - jitter), float(i)) is None


def test_one_odd_note_names_no_node_and_a_pace_near_the_line_does_not_flap() -> None:
    paces = Paces()
    paces.note("a", n(1, 1, 0, 0, window_steps=40, demand=0.4), 0.0)
    assert paces.note("b", n(1, 1, 0, 0, window_steps=40, demand=0.95), 0.0) is None   # one note: a phase?
    assert paces.note("b", n(1, 2, 0, 0, window_steps=40, demand=0.4), 1.0) is None
    said = []
    for i in range(20):          # named at gap 0.3, then it hovers at 0.15: above the clearing line
        gap = 0.3 if i < 3 else 0.15
        paces.note("a", n(1, i, 0, 0, window_steps=12, demand=0.5), 2.0 + 5.0 * i)
        said.append(paces.note("b", n(1, i, 0, 0, window_steps=12, demand=0.5 + gap), 2.0 + 5.0 * i))
    assert said.count(True) == 1 and False not in said and paces.slow() == ["b"]


def test_in_a_large_job_the_slow_node_is_still_named_against_the_jobs_median() -> None:
    paces = Paces()
    said = []
    for i in range(6):
        for k in range(100):
            paces.note(f"n{k}", n(1, i, 0, 0, window_steps=12, demand=0.4), 5.0 * i)
        said.append(paces.note("slowest", n(1, i, 0, 0, window_steps=12, demand=0.95), 5.0 * i + 0.5))
    assert said.count(True) == 1 and paces.slow() == ["slowest"]


def test_a_window_of_few_steps_says_nothing_of_pace() -> None:
    paces = Paces()
    for i in range(10):          # a checkpoint write or an eval: a step or two per note, whatever the demand
        paces.note("a", n(1, i, 0, 0, window_steps=1, demand=0.3), float(i))
        assert paces.note("b", n(1, i, 0, 0, window_steps=PACE_MIN_STEPS - 1, demand=1.0), float(i)) is None
    assert paces.slow() == []
