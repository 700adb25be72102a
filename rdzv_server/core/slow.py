"""Slow nodes: in a job whose ranks step together, everyone waits on the slowest node, and the slowest node waits
on nobody. Each note says how much of its window a node's ranks ran or waited for a CPU (`demand`); the rest they
waited on the others. A node holds the job back when the other nodes wait SLOW_GAP more of their time than it
does, over SLOW_STEPS steps and SLOW_NOTES notes in a row; it is named slow then, and cleared after as many
below CLEAR_GAP.
Pure; memory only (a server that takes over measures again).

What it cannot see: time on a GPU. With NCCL the CPU waits for kernels the same way whether the GPU computes
or waits on a peer, so on GPU nodes it names only nodes slow on their CPU side (data loading, Python).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from protocol.messages import PACE_MIN_STEPS, ProgressNote

SLOW_GAP = 0.2          # named: the others wait this much more of each step than the node does ...
CLEAR_GAP = 0.1         # ... and cleared below this (a pace near the line does not flap)
SLOW_STEPS = 10         # ... over this many steps in a row
SLOW_NOTES = 2          # ... and this many notes (one note's window may hold a phase the others' do not)
NOTE_FRESH_S = 10.0     # a node's last note counts this long (older: another phase of the job)
EXACT_UP_TO = 32        # nodes; in a larger job the others' median is the job's, taken at most every MEDIAN_EVERY_S
MEDIAN_EVERY_S = 1.0    # (one node moves it little; a note per node per lease / 3 must not cost O(nodes))


@dataclass
class NodePace:
    demand: float = 0.0
    at: float = 0.0
    streak: int = 0          # steps in a row on the other side of the line than `slow` says
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
        pace.demand, pace.at = n.demand, now
        others = self._others(node_id, now)
        if others is None:
            return None
        pace.gap = (1 - others) - (1 - pace.demand)
        holds_back = pace.gap >= (CLEAR_GAP if pace.slow else SLOW_GAP)
        if holds_back == pace.slow:
            pace.streak = pace.notes = 0
            return None
        pace.streak += n.window_steps
        pace.notes += 1
        if pace.streak < SLOW_STEPS or pace.notes < SLOW_NOTES:
            return None
        pace.slow, pace.streak, pace.notes = holds_back, 0, 0
        return holds_back

    def _others(self, node_id: str, now: float) -> float | None:
        """The median demand of the other nodes' fresh notes (None: none)."""
        if len(self.nodes) > EXACT_UP_TO and now - self._median_at < MEDIAN_EVERY_S:
            return self._median
        fresh = [p.demand for node, p in self.nodes.items()
                 if now - p.at <= NOTE_FRESH_S and (node != node_id or len(self.nodes) > EXACT_UP_TO)]
        median = statistics.median(fresh) if fresh else None
        if len(self.nodes) > EXACT_UP_TO:
            self._median, self._median_at = median, now
        return median

    def slow(self) -> list[str]:
        return sorted(node for node, p in self.nodes.items() if p.slow)
