"""Slow nodes by the measured wait (rdzv_server/core/slow.py): the node the others wait on waits least, whatever
made it slow; a window of solo work names nobody; a millisecond step's jitter is under the floor; nodes are
compared only with nodes measured alike."""
from __future__ import annotations

from protocol.notes import ProgressNote
from rdzv_server.core.slow import SLOW_NOTES, SLOW_SPAN_S, SLOW_STEPS, Paces


def w(waited: float, *, demand: float = 0.5, steps: int = 5, step_s: float = 0.2) -> ProgressNote:
    return ProgressNote(round_id=1, probes=2, steps=100, step_s=step_s, window_s=steps * step_s, window_steps=steps,
                        demand=demand, waited=waited)


CLOCKS: dict[int, float] = {}      # each Paces' time, on from one feed to the next


def feed(paces: Paces, notes: dict[str, ProgressNote], looks: int, every_s: float = 5.0) -> list[tuple[str, bool]]:
    """`looks` notes of every node, `every_s` apart (a node's note comes with its polls, every few seconds)."""
    changes = []
    for _ in range(looks):
        now = CLOCKS[id(paces)] = CLOCKS.get(id(paces), -every_s) + every_s
        for node, note in notes.items():
            named = paces.note(node, note, now)
            if named is not None:
                changes.append((node, named))
    return changes


def test_the_node_that_waits_least_is_named_once_confirmed_and_cleared_when_it_keeps_pace() -> None:
    paces = Paces()
    slow = {"a": w(0.15), "b": w(0.02), "c": w(0.14)}        # a and c wait ~13 % of each step on b
    assert feed(paces, slow, max(SLOW_NOTES, SLOW_STEPS // 5) - 1) == []      # not confirmed yet
    assert feed(paces, slow, 1) == [("b", True)] and paces.slow() == ["b"]
    assert feed(paces, {"a": w(0.05), "b": w(0.04), "c": w(0.06)}, 10) == [("b", False)]
    assert paces.slow() == []


def test_a_window_of_solo_work_names_nobody_even_when_its_cpu_demand_says_otherwise() -> None:
    paces = Paces()
    feed(paces, {"a": w(0.05), "b": w(0.05), "c": w(0.05)}, 3)
    # Rank 0 on b computes alone while the others wait: the probe leaves the long step out, so b's window has
    # no measure (-1), and its CPU demand (all of it, against the others' nothing) is not compared instead.
    solo = {"a": w(0.05, demand=0.0), "b": w(-1.0, demand=1.0), "c": w(0.05, demand=0.0)}
    assert feed(paces, solo, 20) == [] and paces.slow() == []


def test_a_gap_under_the_floor_per_step_names_nobody() -> None:
    paces = Paces()
    tiny = {"a": w(0.3, step_s=0.004), "b": w(0.0, step_s=0.004), "c": w(0.3, step_s=0.004)}   # 1.2 ms a step
    assert feed(paces, tiny, 20) == []


def test_nodes_measured_differently_are_not_compared() -> None:
    paces = Paces()
    # b measures no wait (its demand says it computed all the time); a and c do: nobody is compared with b
    mixed = {"a": w(0.3, demand=0.2), "b": w(-1.0, demand=1.0), "c": w(0.3, demand=0.2)}
    assert feed(paces, mixed, 20) == []


def test_a_few_seconds_of_contention_name_nobody_however_many_steps_and_notes() -> None:
    """30 ms steps and a snapshot's digest every 10 steps bring a note every 0.3 s: 20 steps and 3 notes pass within
    a second. Two identical nodes on a busy host took turns being named slow every few seconds this way (and, with
    --replace-slow-nodes, a healthy one was swapped for the spare). Slowness that lasts SLOW_SPAN_S is named."""
    paces = Paces()
    even = {"a": w(0.3, steps=10, step_s=0.03), "b": w(0.3, steps=10, step_s=0.03)}
    blip = {"a": w(0.4, steps=10, step_s=0.03), "b": w(0.05, steps=10, step_s=0.03)}     # b held a CPU back
    assert feed(paces, even, 5, every_s=0.3) == []
    assert feed(paces, blip, int(3 / 0.3), every_s=0.3) == [] and paces.slow() == []    # 3 s: 100 steps, 10 notes
    assert feed(paces, even, 3, every_s=0.3) == []
    assert feed(paces, blip, int(SLOW_SPAN_S / 0.3) + 1, every_s=0.3) == [("b", True)]   # it lasts: slow
