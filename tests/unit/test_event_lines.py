"""The server logs a job's events at a bounded rate (rdzv_server/logs.py EventLines): a client joining and leaving
in a loop cannot fill the disk; what was not logged is counted and said once, and other kinds and jobs go on."""
from __future__ import annotations

from rdzv_server.logs import EVENT_LINES, EVENT_WINDOW_S, EventLines


def test_past_the_rate_events_are_counted_and_the_count_said_once_the_window_ends() -> None:
    lines = EventLines()
    shown = [lines.admit("j", "node_joined", 0.001 * i) for i in range(3 * EVENT_LINES)]
    assert [show for show, _ in shown].count(True) == EVENT_LINES and all(skipped == 0 for _, skipped in shown)
    assert lines.admit("j", "node_left", 0.5) == (True, 0)            # another kind: its own window
    assert lines.admit("k", "node_joined", 0.5) == (True, 0)          # another job: its own
    assert lines.admit("j", "node_joined", EVENT_WINDOW_S + 1) == (True, 2 * EVENT_LINES)
    assert lines.admit("j", "node_joined", EVENT_WINDOW_S + 2) == (True, 0)


def test_the_windows_remembered_are_bounded() -> None:
    lines = EventLines()
    for i in range(10_000):
        lines.admit(f"job-{i}", "node_joined", float(i) * EVENT_WINDOW_S)
    assert len(lines._windows) <= 4096 + 1
