"""What one server holds at most, and one job: refusals past these come before anything changes (rendezvous.py)."""
from __future__ import annotations

from dataclasses import dataclass

from protocol.messages import JobConfig
from rdzv_server.core.unhealthy import DEFAULT_HOLD_S


@dataclass(frozen=True)
class Limits:
    """What one server holds at most (`rdzv-server --retain-finished`, `--max-jobs`, `--max-nodes`)."""
    retain_finished_s: float = 3600.0    # a finished job is forgotten this long after it ended
    max_jobs: int = 10_000               # jobs held, finished ones included (the oldest finished go first)
    max_nodes: int = 1_000_000           # node records over all jobs
    unhealthy_hold_s: float = DEFAULT_HOLD_S   # a host that left unhealthy is kept out this long (0: never)


def node_room(config: JobConfig) -> int:
    """Node records one job may hold: its max_nodes, plus as many (at least 16) spares and waiters."""
    return config.max_nodes + max(16, config.max_nodes)
