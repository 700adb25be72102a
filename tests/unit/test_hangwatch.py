"""Pure hang detection: which local ranks stopped beating, with plain-float time."""
from __future__ import annotations

from node_agent.core.hangwatch import HangWatch


def test_hang_watch_ignores_ranks_that_never_beat_and_reports_the_silent_one() -> None:
    w = HangWatch(5.0)
    assert w.next_deadline() is None and w.overdue(100.0) == []
    w.beat(0, 10.0)
    w.beat(1, 12.0)
    assert w.next_deadline() == 15.0
    assert w.overdue(14.9) == []
    w.beat(0, 14.0)
    assert w.overdue(17.0) == [1]
    assert w.overdue(20.0) == [1, 0]


def test_hang_watch_forgets_a_rank_that_exited() -> None:
    w = HangWatch(1.0)
    w.beat(0, 0.0)
    w.beat(1, 0.0)
    w.forget(0)
    assert w.overdue(5.0) == [1]
