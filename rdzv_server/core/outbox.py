"""What one call of the rendezvous core did, handed to the shell as data: nobody diffs state to find out.
The shell drains it once per call: logging and metrics take `events`, long-polls wake on `woken`, the store writes
`changed` (resets `new_runs`, deletes `pruned`), metrics count `restarts` and `suspects`, the deadline timer
re-arms to `earliest`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from rdzv_server.core.records import Event, JobRecord


@dataclass
class Outbox:
    """The effects of core calls since the shell last drained it."""
    events: list[tuple[JobRecord, Event]] = field(default_factory=list)   # in the order recorded
    woken: set[str] = field(default_factory=set)        # jobs where some node's view changed
    changed: dict[str, JobRecord] = field(default_factory=dict)   # jobs whose saved state changed
    nodes: dict[str, set[str]] = field(default_factory=dict)      # job -> nodes whose saved record changed
    new_runs: set[str] = field(default_factory=set)     # job ids that started a new run (history reset)
    pruned: set[str] = field(default_factory=set)       # finished jobs forgotten after their retention
    restarts: list[str] = field(default_factory=list)   # one entry per accepted failure report that restarts
    suspects: list[str] = field(default_factory=list)   # what was done with each suspect node (suspects.Action)
    finished: list[str] = field(default_factory=list)   # jobs that ended (the registry's own: rendezvous.py)
    earliest: float | None = None                       # the earliest deadline set (None: none set)

    def deadline(self, at: float) -> None:
        if self.earliest is None or at < self.earliest:
            self.earliest = at

    def drain(self) -> Outbox:
        """Everything collected so far, leaving this outbox empty."""
        if not (self.events or self.woken or self.changed or self.new_runs or self.restarts or self.pruned
                or self.suspects) and self.earliest is None:
            return _EMPTY          # the common case (a renewal): nothing to allocate
        taken = Outbox(self.events, self.woken, self.changed, self.nodes, self.new_runs, self.pruned,
                       self.restarts, self.suspects, self.finished, self.earliest)
        self.events, self.woken, self.changed, self.nodes = [], set(), {}, {}
        self.new_runs, self.pruned, self.restarts, self.finished, self.earliest = set(), set(), [], [], None
        self.suspects = []
        return taken


_EMPTY = Outbox()
