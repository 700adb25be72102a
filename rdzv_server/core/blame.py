"""Who a failed round counts against. Every node's workers fail when one node's worker crashes (their collective
broke), and whichever report arrives first fails the round (reports.fail_round). The root cause is the earliest
failure by its timestamp, so a later report that names an earlier failure takes over the round's blame: the
count toward `--exclude-after` moves to its node, and an exclusion the wrong count caused is undone. One record
(JobRecord.blame) owns it, so a node is never counted twice for one round nor a healthy one left blamed."""
from __future__ import annotations

from protocol.bounds import MAX_EXCLUDE_AFTER
from protocol.messages import JobState, WorkerFailure
from protocol.peer_gone import broken_by_peer
from rdzv_server.core import exclusions, leases
from rdzv_server.core.events import EventKind, RoundCause
from rdzv_server.core.job_rules import JobRules
from rdzv_server.core.payloads import WorkerFailed
from rdzv_server.core.records import Blame, JobRecord, NodeRecord
from rdzv_server.core.standing import describe

# Failures a node's record keeps (the newest, inside the window): --exclude-after counts at most this many, so the
# rule is unchanged, and a job that never excludes (--exclude-after 0) or has a long window does not grow a node's
# record (and the blame's copy of it, both rewritten at every failure) by one time per crash for ever.
MAX_FAILURE_TIMES = MAX_EXCLUDE_AFTER


def count(rules: JobRules, node: NodeRecord, now: float, was: Blame | None = None) -> None:
    """Count the running round's failure against `node` (its report was the first), or the count `was` moved
    to it (its round, members and the nodes it moved off kept)."""
    job = rules.job
    recent = [t for t in node.failure_times if t > now - job.config.exclude_window_s] + [now]
    node.failure_times = recent[-MAX_FAILURE_TIMES:]
    job.blame = Blame(node_id=node.node_id, counted_at=now, before=list(node.failure_times[:-1]))
    if was is not None:
        job.blame.round_start, job.blame.members = was.round_start, was.members
        job.blame.held = was.held + [was.node_id]
    elif job.round is not None:
        job.blame.round_start, job.blame.members = job.round.completed_at, list(job.round.members)
    rules.node_changed(node.node_id)


def victim_after_cause(job: JobRecord, late: WorkerFailure) -> bool:
    """Whether a late failure reads as a broken collective (a victim's) while the root cause reads as an error
    of its own: hosts' clocks differ by more than the milliseconds between a crash and its peers' broken
    collectives, so its earlier stamp is the skew's, and it takes neither the root cause nor the count."""
    return job.root_cause is not None and broken_by_peer(late) and not broken_by_peer(job.root_cause)


def trusted(job: JobRecord, node_id: str, timestamp: float) -> bool:
    """Whether a late report's failure may move the blame: an agent's clock (or a hostile agent) stamps what it
    likes, so only a time inside the failed round (after it formed, before the first report arrived) counts,
    from one of its members; else a stamp of 1.0, or a spare's report, took the blame off the node that crashed."""
    was = job.blame
    return was is None or (was.round_start <= timestamp <= was.counted_at
                           and (not was.members or node_id in was.members))


def excluded(rules: JobRules, node: NodeRecord, first: WorkerFailure, now: float) -> None:
    """The count just made excluded its node (undone if the blame moves, or, for a failure before its process
    group, if another node's workers fail so: readmit_alike)."""
    if rules.job.blame is not None:
        rules.job.blame.excluded = True
    node.alone_excluded_at = now if first.before_group else 0.0


def late_root_cause(rules: JobRules, node: NodeRecord, round_id: int, first: WorkerFailure, now: float) -> None:
    """A report on the last failed round, after it failed, names an earlier failure (`first`) than its root cause:
    `first` becomes the root cause, shown as such, and the round's count moves to `node`."""
    job = rules.job
    job.root_cause = job.last_failure = first
    rules.changed()
    rules.record(now, EventKind.WORKER_FAILED, f"root cause of round {round_id}: {describe(first)} on node "
                 f"{node.node_id} (reported after the round failed; it came first"
                 f"{'' if job.state is JobState.FAILED else ': the count moves to it'})",
                 node.node_id, round_id,
                 WorkerFailed.of(first))
    if job.state is JobState.FAILED:     # the budget's end: its reason names the root cause; nothing else counts
        job.reason = job.reason.split("; root cause: ")[0] + f"; root cause: {describe(first)}"
        return
    was = job.blame
    if was is None or was.node_id == node.node_id:
        return                               # nothing was counted (a hang's stand-in, a held failure), or it was
    if node.node_id in was.held:
        return      # it held this count once: two agents stamping ever earlier times must not flip exclusions
    wrong = job.nodes.get(was.node_id)
    if wrong is not None:
        _unblame(rules, wrong, was, round_id, now)
    job.blame = None
    # the node whose worker failed first takes the count (its exclusion then, as a first report's would)
    count(rules, node, now, was)
    if excludes(rules, node, first, now):
        member = job.round is not None and node.node_id in job.round.members
        exclusions.exclude(rules, node, now)
        excluded(rules, node, first, now)
        if member:      # it left the round just formed: the next one forms without it
            rules.form_round(now, f"node {node.node_id} excluded", RoundCause.FAILURE)


def elsewhere(job: JobRecord, node: NodeRecord, first: WorkerFailure, now: float) -> str:
    """Another node whose workers failed before their process group within the window, while `first`, counted
    against `node`, did too ("": none): the same start-up failure on two nodes is the script's (an ImportError, a
    bad path), not a node's, so it excludes neither (their budget still ends the job). A late report proves it of
    one round (shared), but the others' workers are often stopped before they fail: this holds across rounds."""
    return next(iter(alike(job, node, first, now)[1:]), "")


def alike(job: JobRecord, node: NodeRecord, first: WorkerFailure, now: float) -> list[str]:
    """`node` and the other nodes whose workers failed before their process group within the window, as `first`
    did ([]: it did not, or no other node did): the job's end names them (reports.fail_round)."""
    others = [n.node_id for n in job.nodes.values() if n.node_id != node.node_id
              and 0 < n.alone_failed_at > now - job.config.exclude_window_s] if first.before_group else []
    return [node.node_id, *others] if others else []


def member_of_failed(job: JobRecord, node: NodeRecord, round_id: int) -> bool:
    """Whether `node` was a member of `round_id`, the round whose failure was just counted: a late report speaks
    for its own workers in that round only. Else any node's report on a round long gone, or never run, kept
    every other node from its exclusion for a window (elsewhere)."""
    return round_id == job.root_cause_round and node.node_id in job.root_cause_members


def excludes(rules: JobRules, node: NodeRecord, first: WorkerFailure, now: float) -> bool:
    """Whether the count just made against `node` excludes it (--exclude-after), and if it does not only
    because another node failed alike (elsewhere), why, in the job's events."""
    cfg = rules.job.config
    if not cfg.exclude_after or len(node.failure_times) < cfg.exclude_after or node.node_id in rules.job.excluded:
        return False
    other = elsewhere(rules.job, node, first, now)
    if other:
        rules.record(now, EventKind.NOT_EXCLUDED, f"node {node.node_id} is not "
                     f"excluded after {len(node.failure_times)} worker failures: node {other}'s workers failed before "
                     f"their process group too within {cfg.exclude_window_s:g}s (the script's error, not a node's)",
                     node.node_id)
    return not other


def readmit_alike(rules: JobRules, node: NodeRecord, now: float) -> None:
    """`node`'s workers just failed before their process group: a node excluded within the window for failures
    before its own (excludes) is readmitted. In the first rounds the first to report is counted each time and the
    others' workers are stopped before their own failure, so it was excluded before anything said the script
    fails everywhere (3 agents, an ImportError: 2 runs of 6). A node excluded for other failures stays out. A
    suspicion such an exit of its own made (suspects.act) is taken back too: else its next real one excluded it."""
    job = rules.job
    for other in [n for n in job.nodes.values() if n.node_id != node.node_id and n.alone_suspects]:
        taken = [t for t in other.suspect_times if t in other.alone_suspects and t > now - job.config.exclude_window_s]
        other.suspect_times = [t for t in other.suspect_times if t not in taken]
        other.alone_suspects = []
        rules.node_changed(other.node_id)
        if taken:
            rules.record(now, EventKind.NOT_EXCLUDED, f"node {other.node_id} is no longer a suspect: its workers' "
                         f"exit before their process group came on node {node.node_id} too (the script's error)",
                         other.node_id)
    for other in [job.nodes[n] for n in job.excluded if n != node.node_id and n in job.nodes]:
        if 0 < other.alone_excluded_at > now - job.config.exclude_window_s:
            other.alone_excluded_at, other.exclusions = 0.0, max(0, other.exclusions - 1)
            _readmit(rules, other, now, [], f"its workers failed before their process group, as node "
                                            f"{node.node_id}'s did too since (the script's error, not a node's)")


def shared(rules: JobRules, node: NodeRecord, round_id: int, failures: list[WorkerFailure], now: float) -> None:
    """A late report on the round just counted, from another of its members, names a worker that failed before
    its process group (no peer's loss broke it) while the counted one did too: the workers failed on their own on
    more than one node, the script's error (an ImportError, a bad path), not a node's. The count, and an exclusion
    it caused, are taken back: else a script failing everywhere excluded the nodes one by one (the job shrank, or
    waited out cooldowns) before its budget ended it."""
    job, was, cause = rules.job, rules.job.blame, rules.job.root_cause
    own = [f for f in failures if f.before_group]
    if was is None or cause is None or not cause.before_group or not own or job.root_cause_round != round_id \
            or was.node_id == node.node_id or (was.members and node.node_id not in was.members) \
            or own[0].timestamp < was.round_start:
        return
    rules.record(now, EventKind.WORKER_FAILED, f"{describe(own[0])} on node {node.node_id} in round {round_id} too, "
                 f"before its process group, as on node {was.node_id}: the script fails on more than one node (its "
                 f"error, not a node's), counted against neither", node.node_id, round_id, WorkerFailed.of(own[0]))
    wrong = job.nodes.get(was.node_id)
    if wrong is not None:
        _unblame(rules, wrong, was, round_id, now, f"was not its own: node {node.node_id}'s workers failed "
                                                   f"before their process group too (the script's error)")
    job.blame = None


def _unblame(rules: JobRules, node: NodeRecord, was: Blame, round_id: int, now: float,
             why: str = "followed another node's earlier one (the root cause)") -> None:
    """Take back the count `was` made against `node`, and the exclusion it caused."""
    job = rules.job
    if not was.excluded:
        if was.counted_at in node.failure_times:
            node.failure_times.remove(was.counted_at)
        rules.node_changed(node.node_id)
        return
    node.exclusions = max(0, node.exclusions - 1)   # not its fault: its next cooldown does not double for it
    rules.node_changed(node.node_id)
    if node.node_id not in job.excluded:
        return                               # its exclusion already ended (or an operator cleared it)
    _readmit(rules, node, now, list(was.before), f"its failure in round {round_id} {why}")


def _readmit(rules: JobRules, node: NodeRecord, now: float, failure_times: list[float], why: str) -> None:
    """End `node`'s exclusion now, its failures toward the next one `failure_times`: admitted, or lost when its
    agent is gone."""
    job = rules.job
    node.excluded_until, node.failure_times = now, failure_times
    rules.node_changed(node.node_id)
    rules.record(now, EventKind.NODE_READMITTED, f"node {node.node_id} readmitted: {why}", node.node_id)
    rules.wake()
    if leases.live(node, now):
        rules.admit(node, now)
    else:       # its agent is gone (as an operator's clear, operator_rules.py): admitted, it would fill a round no
        # agent runs; left excluded, the next tick would readmit it a second time, as if its cooldown had ended
        rules.remove(node, now, EventKind.NODE_LOST, f"node {node.node_id} lost: {leases.why_lapsed(job, node, now)}"
                     f"; its next agent joins afresh")


def ended_round(rules: JobRules, node: NodeRecord, round_id: int, first: WorkerFailure, now: float) -> bool:
    """A failure of the round a leave or loss just ended, the job now waiting with no round (torchrun: a node's
    agent leaves once its workers fail, its peer's report comes after): no restart counted, but it is the job's
    last failure and the root cause its end names (else a join timeout named only the missing nodes)."""
    job = rules.job
    if job.round is not None or round_id != job.last_round_id:
        return False
    if job.root_cause_round == round_id and job.root_cause is not None and \
            job.root_cause.timestamp <= first.timestamp:
        return True                               # an earlier one of that round is already kept
    job.root_cause, job.root_cause_round, job.last_failure, job.blame = first, round_id, first, None
    job.root_cause_members = []
    rules.changed()
    rules.record(now, EventKind.WORKER_FAILED, f"{describe(first)} on node {node.node_id}, in round {round_id} "
                 f"that had already ended (no restart counted)", node.node_id, round_id,
                 WorkerFailed.of(first))
    return True
