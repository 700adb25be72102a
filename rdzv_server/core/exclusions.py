"""A node kept out of its job for a cooldown that doubles each time: after too many worker failures (reports.py),
or as a suspect (suspects.py, swaps.py). It is readmitted when the cooldown ends (JobRules.tick) or an operator
clears it (operator_rules.py); a flapping host is held off at its join (admission.py)."""
from __future__ import annotations

from protocol.messages import NodeState
from rdzv_server.core import places
from rdzv_server.core.events import EventKind
from rdzv_server.core.job_rules import JobRules
from rdzv_server.core.records import NodeRecord


def exclude(rules: JobRules, node: NodeRecord, now: float, why: str = "") -> None:
    """Keep the node out for its next cooldown; `why`: the reason ("": too many failures)."""
    job, cfg = rules.job, rules.job.config
    cooldown = min(cfg.exclude_cooldown_s * (2 ** node.exclusions), cfg.exclude_cooldown_max_s)
    node.exclusions += 1
    node.excluded_until = now + cooldown
    node.held_off = node.slow_out = False
    node.alone_excluded_at = 0.0      # set again when failures before its group caused it (blame.excluded)
    rules.node_changed(node.node_id)
    rules.out.deadline(node.excluded_until)
    node.failure_times = []
    places.move(job, node, NodeState.EXCLUDED)
    if job.round is not None and node.node_id in job.round.members:
        job.round.members = [m for m in job.round.members if m != node.node_id]
    failures = f"{cfg.exclude_after} worker failure{'s' * (cfg.exclude_after != 1)}"
    why = why or f"after {failures} within {cfg.exclude_window_s:g}s"
    rules.record(now, EventKind.NODE_EXCLUDED, f"node {node.node_id} excluded for {cooldown:g}s {why}", node.node_id)
