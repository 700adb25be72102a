"""Slow nodes: in a job whose ranks step together, everyone waits on the slowest node, and the slowest node waits
on nobody. Each note says how much of its window's steps a node's ranks waited on the others (`waited`: blocked
in a backward pass or a collective, whatever made the slow node slow: compute, I/O, a data loader, sleep); a
node holds the job back when the other nodes wait SLOW_GAP more of their time than it does, and at least
FLOOR_S more per step, over SLOW_STEPS steps and SLOW_NOTES notes in a row lasting SLOW_SPAN_S; it is named slow
then, and cleared after as many steps and notes below CLEAR_GAP. Steps far longer than the node's typical one
(an evaluation, a rank's solo work) are not in the measure (the probe leaves them out), so they name nobody.
A job whose nodes measure no wait (no backward, no collective timed: a `beat()` loop) is compared by its ranks'
CPU demand instead (`demand`: the rest of the window they waited), against DEMAND_GAP; a node is compared only
with nodes measured the same way. Pure; memory only (a server that takes over measures again).

What it cannot see: time on a GPU. NCCL's collectives are queued on the GPU and return to the host at once, so
a node slow on its GPU is not named (its notes say `on_device`; progress_rules.py says so once).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from protocol.notes import PACE_MIN_STEPS, ProgressNote

SLOW_GAP = 0.1          # named: the others wait this much more of each step than the node does ...
CLEAR_GAP = 0.05        # ... and cleared below this (a pace near the line does not flap)
FLOOR_S = 0.005         # ... and at least this much more per step (a millisecond step's jitter is no pace)
DEMAND_GAP, DEMAND_CLEAR_GAP = 0.2, 0.1    # the same by CPU demand: a coarser measure (a sleep looks like a wait)
SLOW_STEPS = 20         # ... over this many steps in a row (+-30 % per-step jitter on every rank names nobody)
SLOW_NOTES = 3          # ... and this many notes (one note's window may hold a phase the others' do not)
# ... and for this long: steps and notes alone can pass within a second (30 ms steps, a note per snapshot's
# digest), and a second's contention for a CPU (a GC pause, a neighbour's burst) is no slow node. A review
# saw two identical nodes named slow in turn every few seconds, and a healthy one swapped for the spare.
SLOW_SPAN_S = 10.0
NOTE_FRESH_S = 10.0     # a node's last note counts this long (older: another phase of the job)
EXACT_UP_TO = 32        # nodes; in a larger job the others' median is the job's, taken at most every MEDIAN_EVERY_S
MEDIAN_EVERY_S = 1.0    # (one node moves it little; a note per node per lease / 3 must not cost O(nodes))


@dataclass
class NodePace:
    wait: float = 0.0        # the share of its window it waited on the others, ...
    measured: bool = False   # ... as measured (`waited`), or as the rest of its CPU demand
    at: float = 0.0
    streak: int = 0          # steps in a row on the other side of the line than `slow` says
    since: float = 0.0       # ... since when (the start of the streak's first note's window)
    notes: int = 0           # ... and notes
    slow: bool = False
    gap: float = 0.0         # how much more the others waited, at the last note


@dataclass
class Paces:
    """One job's nodes' paces."""
    nodes: dict[str, NodePace] = field(default_factory=dict)
    _median: float | None = None
    _median_at: float = float("-inf")

    def note(self, node_id: str, n: ProgressNote, now: float) -> bool | None:
        """Take a node's note; True: it is named slow now, False: no longer, None: no change."""
        if n.window_s <= 0 or n.window_steps < PACE_MIN_STEPS:
            return None
        pace = self.nodes.setdefault(node_id, NodePace())
        if n.waited < 0 and pace.measured:
            return None         # a window with too few steps of the usual kind (solo work): no measure
        pace.wait, pace.measured = (n.waited, True) if n.waited >= 0 else (1 - n.demand, False)
        pace.at = now
        others = self._others(node_id, pace.measured, now)
        if others is None:
            return None
        pace.gap = others - pace.wait
        line = (CLEAR_GAP, SLOW_GAP) if pace.measured else (DEMAND_CLEAR_GAP, DEMAND_GAP)
        holds_back = pace.gap >= line[not pace.slow] and pace.gap * n.step_s >= FLOOR_S
        if holds_back == pace.slow:
            pace.streak = pace.notes = 0
            return None
        if pace.notes == 0:
            pace.since = now - n.window_s
        pace.streak += n.window_steps
        pace.notes += 1
        if pace.streak < SLOW_STEPS or pace.notes < SLOW_NOTES or (holds_back and now - pace.since < SLOW_SPAN_S):
            return None
        pace.slow, pace.streak, pace.notes = holds_back, 0, 0
        return holds_back

    def _others(self, node_id: str, measured: bool, now: float) -> float | None:
        """The median wait of the other nodes' fresh notes measured alike (None: none)."""
        if len(self.nodes) > EXACT_UP_TO and now - self._median_at < MEDIAN_EVERY_S:
            return self._median
        fresh = [p.wait for node, p in self.nodes.items() if now - p.at <= NOTE_FRESH_S and p.measured == measured
                 and (node != node_id or len(self.nodes) > EXACT_UP_TO)]
        median = statistics.median(fresh) if fresh else None
        if len(self.nodes) > EXACT_UP_TO:
            self._median, self._median_at = median, now
        return median

    def slow(self) -> list[str]:
        return sorted(node for node, p in self.nodes.items() if p.slow)
