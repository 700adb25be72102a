"""A suspect node: one of its workers exited with a code the job names (`suspect_exit_codes`, by default
Megatron's 16, "run this step again on other hardware", and 17, "a validation failed"). Its failure is counted
as any other (one restart), and then, by the one rule here:
- with a ready spare, the node is held out (an exclusion, for the job's cooldown) and the spare takes its place
  and ranks in the round that follows, fetching its snapshots from their copies: the job goes on elsewhere at
  the first such exit, not after `exclude_after` of them. Once readmitted it takes no place until its agent's
  node checks (the GPU check, --health-check) pass once more (NodeStatus.checks_due);
- without one, the job restarts on the same nodes, said once per suspicion, and a second suspicion of the node
  within `exclude_window_s` excludes it: the job never loops on a node that keeps asking to leave.
"""
from __future__ import annotations

import enum

from protocol.messages import FailureReason, JobConfig, WorkerFailure
from rdzv_server.core import exclusions
from rdzv_server.core.events import EventKind
from rdzv_server.core.job_rules import JobRules
from rdzv_server.core.records import NodeRecord
from rdzv_server.core.standing import describe


class Action(str, enum.Enum):
    REPLACED = "replaced"      # held out; a ready spare takes its place
    EXCLUDED = "excluded"      # a suspect again within the window
    KEPT = "kept"              # no ready spare: the job restarts on it


def asking(cfg: JobConfig, failures: list[WorkerFailure]) -> WorkerFailure | None:
    """The first failure whose exit code asks for other hardware, or None."""
    return next((f for f in failures if f.exitcode in cfg.suspect_exit_codes), None)


def act(rules: JobRules, node: NodeRecord, asked: WorkerFailure, round_id: int, now: float) -> Action:
    """The suspect rule for `node`, before the round after the failure forms."""
    cfg = rules.job.config
    suspected(rules, node, now)
    if asked.before_group:      # taken back if other nodes' workers fail so (blame.readmit_alike)
        node.alone_suspects = [t for t in node.alone_suspects if t in node.suspect_times] + [now]
    why = "its replicated tensors diverged" if asked.reason == FailureReason.DIVERGED else \
        "a worker asked for other hardware"
    what = f"node {node.node_id} is a suspect: {why} ({describe(asked)})"
    spare = ready_spare(rules)
    if len(node.suspect_times) >= 2:
        action, then = Action.EXCLUDED, f"the second time within {cfg.exclude_window_s:g}s: it is excluded"
        exclusions.exclude(rules, node, now, f"as a suspect twice within {cfg.exclude_window_s:g}s")
    elif spare is not None:
        action, then = Action.REPLACED, f"spare {spare} takes its place; it is excluded"
        exclusions.exclude(rules, node, now, f"as a suspect ({describe(asked)}): spare {spare} takes its place")
    else:
        action, then = Action.KEPT, (f"no spare is ready, so the job restarts on it; a second time within "
                                     f"{cfg.exclude_window_s:g}s excludes it")
    if action is not Action.KEPT:
        then += quarantine(node, now)
    rules.record(now, EventKind.NODE_SUSPECT, f"{what}; {then}", node.node_id, round_id)
    rules.out.suspects.append(action.value)
    return action


def suspected(rules: JobRules, node: NodeRecord, now: float) -> None:
    """A suspicion of `node` now, counted within the job's exclude window (a second one excludes it)."""
    window = rules.job.config.exclude_window_s
    node.suspect_times = [t for t in node.suspect_times if t > now - window] + [now]
    rules.node_changed(node.node_id)


def quarantine(node: NodeRecord, now: float) -> str:
    """A suspect held out takes no place again until what its agent checks (JoinRequest.checks) passes once more:
    not ready (it is excluded: no waiting count to keep) until then. Returns what to add to its event."""
    if not node.checks:
        return ""
    node.checks_due, node.ready, node.preparing_since, node.preparing_said = True, False, now, True
    return f", and takes no place until its checks ({node.checks}) pass again"


def ready_spare(rules: JobRules) -> str | None:
    job = rules.job
    return next((s for s in job.spares if s in job.nodes and job.nodes[s].ready), None)


def passed(rules: JobRules, node: NodeRecord, now: float) -> None:
    """A suspect's agent says its node checks passed again: it may take a place (as any waiting node)."""
    node.checks_due, node.preparing_said = False, False     # said here: readiness need not say it is ready
    rules.node_changed(node.node_id)
    rules.record(now, EventKind.NODE_READY, f"node {node.node_id} passed its checks again: it may take a place",
                 node.node_id)
