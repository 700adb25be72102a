"""A node's report on the round it ran: a worker failure (the job-wide restart, or the job's end past the budget)
or its success (the job succeeds once every member has). A report about a round that no longer runs is stale and
changes nothing but the node's lease (and, for a late failure, maybe the root cause). The node is authenticated
and its lease renewed before these rules run (requests.py).
"""
from __future__ import annotations

import msgspec

from protocol.errors import ErrorCode
from protocol.messages import FailureReport, JobState, SuccessReport, WorkerFailure
from rdzv_server.core import alone, blame, exclusions, leases, suspects
from rdzv_server.core.errors import RendezvousError
from rdzv_server.core.events import EventKind, RoundCause
from rdzv_server.core.job_rules import JobRules
from rdzv_server.core.payloads import WorkerFailed, WorkersFailed
from rdzv_server.core.records import HeldFailure, JobRecord, NodeRecord
from rdzv_server.core.standing import describe

# A late report may correct the root cause while the job runs, or once it failed (its end names it; doc'd)
LIVE_OR_FAILED = (JobState.WAITING, JobState.RUNNING, JobState.FAILED)
MAX_FAILURE_EVENTS = 8       # worker_failed events one report records; the rest are summed up in one more


def failure(rules: JobRules, node: NodeRecord, req: FailureReport, now: float,
            outage: tuple[float, float] | None = None) -> str:
    """Count a failure of the running round; returns why it was not acted on ("" when it was). `outage`: the
    server's own last outage (Arrival.outage)."""
    job = rules.job
    failures = sorted((_stamp(f, node, now) for f in req.failures), key=lambda f: f.timestamp)
    why_not = not_running(rules, node, req.round_id)
    if any(f.before_group for f in failures) and (not why_not or blame.member_of_failed(job, node, req.round_id)):
        node.alone_failed_at = now     # (blame.elsewhere) only for a round it speaks for: not one long gone
        rules.node_changed(node.node_id)
        blame.readmit_alike(rules, node, now)
    if job.alone_held is not None:
        if job.alone_held.node_id == node.node_id and job.alone_held.round_id == req.round_id and not why_not:
            return "its failure is held already"
        judge_held(rules, node, req.round_id, now)     # another member's word on it: judged first (the earlier)
        why_not = not_running(rules, node, req.round_id)
    if why_not:
        if not job.state.finished:
            blame.shared(rules, node, req.round_id, failures, now)    # failed on its own too: no node's fault
        # A late report on the failed round may hold an earlier failure: the root cause, not counted again.
        if job.state in LIVE_OR_FAILED and req.round_id == job.root_cause_round and job.root_cause is not None \
                and failures[0].timestamp < job.root_cause.timestamp:
            if blame.trusted(job, node.node_id, failures[0].timestamp) and \
                    not blame.victim_after_cause(job, failures[0]):
                blame.late_root_cause(rules, node, req.round_id, failures[0], now)
        elif not job.state.finished:
            blame.ended_round(rules, node, req.round_id, failures[0], now)
        return why_not
    for nid in leases.doubted(job, rules.members(), node.node_id, outage, now):
        rules.node_changed(nid)
    return fail_round(rules, node, req.round_id, failures, now)


def judge_held(rules: JobRules, node: NodeRecord | None, round_id: int, now: float) -> None:
    """The failure alone.py held, judged now if due (`node` None: a tick; else `node` reported on `round_id`)."""
    held = alone.due(rules, node, round_id, now)
    if held is not None:
        fail_round(rules, rules.job.nodes[held.node_id], held.round_id, held.failures, now, judged=True)


def heard(rules: JobRules, node: NodeRecord, now: float) -> None:
    """`node` heard from after the server came back, or after its held poll was answered: a failure held for the
    members (fail_round) is judged once every member is, if its round still runs."""
    node.unheard = False
    job, held = rules.job, rules.job.held_failure
    if held is None:
        return
    if node.node_id in held.waiting_for:
        held.waiting_for.remove(node.node_id)
        rules.changed()
    members = [n for n in rules.members() if n in job.nodes]
    if any(job.nodes[n].unheard or n in held.waiting_for for n in members):
        return
    job.held_failure = None
    rules.changed()
    if job.round is not None and job.round.round_id == held.round_id and held.node_id in job.nodes \
            and not job.state.finished:
        fail_round(rules, job.nodes[held.node_id], held.round_id, held.failures, now, RoundCause(held.cause),
                   held.blamed, doubt=False)


def waited_for(job: JobRecord, node: NodeRecord) -> bool:
    """Whether a held failure waits to hear from `node` (heard() then)."""
    return node.unheard or (job.held_failure is not None and node.node_id in job.held_failure.waiting_for)


def check_failure(rules: JobRules, node: NodeRecord, req: FailureReport) -> None:
    """A report names only the node's own local ranks (a refusal changes nothing)."""
    wrong = [f.local_rank for f in req.failures if f.local_rank >= node.local_world_size]
    if wrong or len(req.failures) > node.local_world_size:
        raise RendezvousError(ErrorCode.BAD_REQUEST, f"the report names {len(req.failures)} failure(s) and local "
                              f"rank(s) {wrong[:5]}, but node {node.node_id} runs {node.local_world_size} workers")


def fail_round(rules: JobRules, node: NodeRecord, round_id: int, failures: list[WorkerFailure], now: float,
               cause: RoundCause = RoundCause.FAILURE, blamed: bool = True, doubt: bool = True,
               judged: bool = False) -> str:
    """The running round failed on `node` (`failures` first in time): a restart counted, or the job's end past
    the budget; returns why it was not (a lost member is the likelier cause). `blamed` False: the node only
    stands for the job (replicas diverged with no majority): nothing counts against it. `doubt` False: a held
    failure judged (heard): the members it waited for were heard from. `judged`: one alone.py held, judged."""
    job = rules.job
    # A member that just dropped or lapsed is the likelier cause (its peers' collectives then break): lost first.
    lapsed = [n for n in rules.members() if n != node.node_id and n in job.nodes
              and not leases.live(job.nodes[n], now)]
    if lapsed:
        rules.lose_all([job.nodes[n] for n in lapsed], now)
        return f"failure attributed to the loss of {', '.join(lapsed)}"
    # After the server came back every member has a fresh lease: one that died with it (a host's reboot) looks
    # alive until its lease lapses; so after an outage of its own (leases.doubted). Its peers' failures wait for it
    # to be heard from (then counted) or lost.
    # A member whose held poll was just answered and that has not polled again holds no connection to close: its
    # agent killed then (SIGKILL) looks alive for its lease. A healthy agent polls again within milliseconds.
    others = [job.nodes[n] for n in rules.members() if n != node.node_id and n in job.nodes]
    unheard = [n.node_id for n in others if n.unheard]
    between = [n.node_id for n in others if n.answered and not n.unheard] if doubt else []
    if unheard or between:
        if job.held_failure is None or job.held_failure.round_id != round_id:
            job.held_failure = HeldFailure(node_id=node.node_id, round_id=round_id, failures=failures,
                                           cause=cause.value, blamed=blamed, waiting_for=between)
            rules.changed()
        waiting = unheard or between
        why = "nothing was since the server came back or was last out" if unheard else \
            "its held poll was answered and it has not polled again"
        return f"failure held until {', '.join(waiting[:3])} is heard from ({why}; its loss would be the " \
               f"likelier cause)"
    if cause is RoundCause.FAILURE and blamed and not judged and alone.hold(rules, node, round_id, failures, now):
        return f"failure at start held up to {alone.WAIT_S:g}s for the other members' word (the script's, if " \
               f"theirs fail so too)"
    first = failures[0]
    job.root_cause, job.root_cause_round, job.last_failure, job.blame = first, round_id, first, None
    job.root_cause_members = rules.members()
    job.restart_count += 1
    for f in failures[:MAX_FAILURE_EVENTS]:
        rules.record(now, EventKind.WORKER_FAILED, describe(f), node.node_id, round_id,
                    WorkerFailed.of(f))
    rest = failures[MAX_FAILURE_EVENTS:]
    if rest:       # one line for the rest: a node of many workers must not flood the history
        rules.record(now, EventKind.WORKER_FAILED, f"and {len(rest)} more worker(s) of node {node.node_id} "
                    f"failed in round {round_id}", node.node_id, round_id,
                    WorkersFailed(count=len(rest), reason=rest[0].reason))
    if blamed:
        blame.count(rules, node, now)
    cfg = job.config
    if job.restart_count > cfg.max_restarts:
        # said before the root cause, which a late report may replace (blame.late_root_cause)
        nodes = blame.alike(job, node, first, now)
        alike = f" (the workers failed at start, before their process group, on {len(nodes)} nodes: " \
            f"{', '.join(nodes[:5])}{', ...' if len(nodes) > 5 else ''}: the script's error, not a node's; " \
            f"their output says which)" if nodes else ""
        rules.finish(now, JobState.FAILED, f"worker failures exceeded max_restarts={cfg.max_restarts}{alike}; "
                    f"root cause: {describe(job.root_cause or first)}")
        return ""
    rules.out.restarts.append(job.job_id)
    what = {RoundCause.HANG: "hang", RoundCause.DIVERGED: "replicas diverged"}.get(cause, "worker failure")
    why = f"{what} on {node.node_id} ({describe(first)}); restart {job.restart_count}/{cfg.max_restarts}"
    asked = suspects.asking(cfg, failures) if cause is RoundCause.FAILURE else \
        failures[0] if cause is RoundCause.DIVERGED and blamed else None
    nodes = blame.alike(job, node, asked, now) if asked is not None and cause is RoundCause.FAILURE else []
    if asked is not None and nodes:     # every node asking at start: the script's own exit code, not a node's
        rules.record(now, EventKind.NOT_EXCLUDED, f"node {node.node_id} is no suspect: its {describe(asked)} came "
                     f"before its process group, as other nodes' workers failed within {cfg.exclude_window_s:g}s "
                     f"({', '.join(nodes[1:4])}): the script's error, not a node's", node.node_id, round_id)
    elif asked is not None and suspects.act(rules, node, asked, round_id, now) is not suspects.Action.KEPT:
        node.alone_excluded_at = now if asked.before_group else 0.0   # (blame.readmit_alike)
    elif blamed and blame.excludes(rules, node, first, now):
        exclusions.exclude(rules, node, now)
        blame.excluded(rules, node, first, now)
    rules.form_round(now, why, cause, failed_at=first.timestamp)
    return ""


def success(rules: JobRules, node: NodeRecord, req: SuccessReport, now: float) -> str:
    """Count a node's success; returns why it was not acted on ("" when it was)."""
    job = rules.job
    why_not = not_running(rules, node, req.round_id)
    if why_not:
        return why_not
    if node.node_id not in job.successes:
        job.successes.append(node.node_id)
        rules.record(now, EventKind.NODE_SUCCEEDED, f"node {node.node_id} finished round {req.round_id}",
                    node.node_id, req.round_id)
    assert job.round is not None
    if set(job.round.members) <= set(job.successes):
        n = len(job.round.members)
        rules.finish(now, JobState.SUCCEEDED, f"{'its one node' if n == 1 else f'all {n} nodes'} of round "
                                              f"{job.round.round_id} succeeded")
    return ""


def not_running(rules: JobRules, node: NodeRecord, round_id: int) -> str:
    """Why a report about `round_id` from `node` is not about the running round ("" when it is)."""
    job = rules.job
    if job.state.finished:
        return f"job already {job.state.value}: {job.reason}"   # the reply names the cause, as a poll would
    if job.round is None or job.round.round_id != round_id:
        current = job.round.round_id if job.round else "none (waiting for nodes)"
        return f"stale: report for round {round_id} but the current round is {current}"
    if node.node_id not in job.round.members:
        return f"stale: node {node.node_id} is not a member of round {round_id}"
    return ""


def _stamp(f: WorkerFailure, node: NodeRecord, now: float) -> WorkerFailure:
    """A copy of `f` with the reporter's host, node id and (when missing) the arrival time."""
    return msgspec.structs.replace(f, host=f.host or node.host, node_id=node.node_id, timestamp=f.timestamp or now)
