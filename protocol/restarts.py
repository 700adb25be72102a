"""Where a restart's time went, phase by phase (node_agent/core/anatomy.py measures it; the server keeps the
slowest node's, the page, `rdzv-ctl job` and /metrics show it)."""
from __future__ import annotations

import msgspec

from protocol.bounds import Rank, Seconds

# In the order a restart passes them: the old workers gone after the node's last step (stop), the new round's
# workers spawned (rendezvous), their interpreters up (start), CUDA's context, the process group, the snapshot's
# restore, and the first step after it; set-up is the script's own time between them (imports, the model).
PHASES = ("stop", "rendezvous", "start", "setup", "cuda", "group", "restore", "first_step")
LABELS = {"stop": "stop", "rendezvous": "rendezvous", "start": "start", "setup": "set-up", "cuda": "CUDA",
          "group": "process group", "restore": "restore", "first_step": "first step"}


class RestartAnatomy(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """One node's restart, as its last rank to step again lived it: seconds per phase (0: the phase did not
    happen, or took no time), summing to the time from the node's last step before it to that rank's first after."""
    rank: Rank
    stop: Seconds = 0.0
    rendezvous: Seconds = 0.0
    start: Seconds = 0.0
    setup: Seconds = 0.0
    cuda: Seconds = 0.0
    group: Seconds = 0.0
    restore: Seconds = 0.0
    first_step: Seconds = 0.0

    @property
    def total(self) -> float:
        return float(sum(getattr(self, p) for p in PHASES))

    def line(self) -> str:
        """"1.70 s: stop 0.10 · start 0.05 · ... (rank 5)": the phases that took time, in order."""
        parts = " · ".join(f"{LABELS[p]} {getattr(self, p):.2f}" for p in PHASES if getattr(self, p) >= 0.005)
        return f"{self.total:.2f} s: {parts} (rank {self.rank})"
