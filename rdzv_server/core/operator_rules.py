"""Operator actions on an open job (refused on a finished one by `rendezvous.py`): close it, drain a node, clear an
exclusion, change min/max. Each raises `RendezvousError` having changed nothing, or records who asked and why.
"""
from __future__ import annotations

from dataclasses import dataclass

import msgspec

from protocol.errors import ErrorCode
from protocol.messages import JobConfig, JobState
from rdzv_server.core import awaiting, leases, places, swaps
from rdzv_server.core.errors import RendezvousError
from rdzv_server.core.events import EventKind, RoundCause
from rdzv_server.core.job_rules import JobRules
from rdzv_server.core.payloads import JobResized


@dataclass(frozen=True)
class CloseJob:
    reason: str


@dataclass(frozen=True)
class DrainNode:
    node_id: str
    reason: str


@dataclass(frozen=True)
class ClearExclusion:
    node_id: str


@dataclass(frozen=True)
class ResizeJob:
    min_nodes: int
    max_nodes: int


OperatorAction = CloseJob | DrainNode | ClearExclusion | ResizeJob


def apply(rules: JobRules, action: OperatorAction, now: float) -> None:
    """One operator action on an open job, by its type."""
    match action:
        case CloseJob(reason=reason):     # agents stop their workers and exit (non-zero: the job did not succeed)
            rules.finish(now, JobState.CLOSED, f"closed by operator: {reason or 'no reason given'}")
        case DrainNode(node_id=node_id, reason=reason):
            drain(rules, node_id, reason, now)
        case ClearExclusion(node_id=node_id):
            clear_exclusion(rules, node_id, now)
        case ResizeJob(min_nodes=min_nodes, max_nodes=max_nodes):
            resize(rules, min_nodes, max_nodes, now)
            swaps.settle(rules, now)        # a drained member waiting for its swap, made a spare: it goes now


def drain(rules: JobRules, node_id: str, reason: str, now: float, by: str = "operator") -> None:
    """Take a node out of the job until its drain is cleared. A member's going re-forms the round at once
    without using the restart budget, as a leave would; its agent sees the node gone and exits. With a spare ready
    and snapshots of its own, it goes as a slow node does (swaps.py): the spare takes its place at the next snapshot,
    fetched from it, and then it goes; its drain is in force from now (it may not rejoin, and lists say it)."""
    job = rules.job
    node = job.nodes.get(node_id)
    if node_id in job.drained:      # (a node in the job and drained: its swap is under way)
        # drained already: the first drain stands (its reason is the job's, its events', its refusals'); another
        # reason here would make the drained list disagree with them. Nothing changes; rdzv-ctl says so.
        return
    why = job.drained.setdefault(node_id, reason or "no reason given")
    if node is None:    # lost or not yet joined: it may not (re)join
        rules.wake()
        rules.record(now, EventKind.NODE_DRAINED, f"node {node_id} (not in the job now) drained by {by}: {why}",
                     node_id)
        if node_id in job.awaited:
            if awaiting.given_up(job, node_id):
                job.last_call_deadline = now        # not awaited any more: the next tick forms the round
            else:
                job.reason = f"node {node_id} drained; {awaiting.waiting(job, now)}"
            rules.out.deadline(job.last_call_deadline or now)
        return
    if swaps.drainable(rules, node_id):
        rules.wake()
        swaps.ask(rules, node_id, f"drained by {by}: {why}", now, drain=True)
        return
    rules.remove(node, now, EventKind.NODE_DRAINED, f"node {node_id} drained by {by}: {why}")


def clear_exclusion(rules: JobRules, node_id: str, now: float) -> None:
    """Readmit an excluded node now (its failure history is forgotten), or lift a drain."""
    job = rules.job
    if node_id in job.drained:
        del job.drained[node_id]
        job.kept_out.pop(node_id, None)      # an exclusion it had when drained: lifted with the drain, as said
        rules.wake()
        rules.record(now, EventKind.NODE_UNDRAINED,
                     f"drain of node {node_id} cleared by operator: it may join again", node_id)
        swaps.lifted(rules, node_id, now)       # a drain still waiting for its swap: called off
        return
    node = job.nodes.get(node_id)
    if node is None and job.kept_out.pop(node_id, None) is not None:    # excluded, then its agent went
        rules.changed()
        rules.record(now, EventKind.NODE_READMITTED, f"exclusion of node {node_id} cleared by operator: its next "
                     f"agent joins afresh", node_id)
        return
    if node is None or node_id not in job.excluded:
        raise RendezvousError(ErrorCode.NOT_FOUND,
                              f"node {node_id!r} is neither excluded nor drained in job {job.job_id!r}")
    node.excluded_until, node.failure_times, node.exclusions = now, [], 0
    rules.node_changed(node_id)
    rules.record(now, EventKind.NODE_READMITTED, f"exclusion of node {node_id} cleared by operator", node_id)
    rules.wake()
    if not leases.live(node, now):
        # its agent is gone (restarting, say): readmitted, it would fill a round at once that no agent runs; its
        # next agent joins afresh (not excluded)
        rules.remove(node, now, EventKind.NODE_LOST, f"node {node_id} lost: {leases.why_lapsed(rules.job, node, now)}"
                     f"; its next agent joins afresh")
        return
    rules.admit(node, now)


def resize(rules: JobRules, min_nodes: int, max_nodes: int, now: float) -> None:
    """Change a job's min/max nodes. Joins keep matching the config the job started with."""
    job = rules.job
    try:
        # convert, not replace: it checks the fields' bounds as a join's decoding would
        config = msgspec.convert({**msgspec.structs.asdict(job.config), "min_nodes": min_nodes,
                                  "max_nodes": max_nodes}, JobConfig)
    except msgspec.ValidationError as exc:
        raise RendezvousError(ErrorCode.BAD_REQUEST, f"cannot resize job {job.job_id!r}: {exc}") from None
    old = job.config
    if job.join_config is None:
        job.join_config = old
    job.config = config
    rules.wake()
    rules.record(now, EventKind.JOB_RESIZED, f"nodes {old.min_nodes}:{old.max_nodes} -> {min_nodes}:{max_nodes} "
                 "by operator", data=JobResized(min_nodes=min_nodes, max_nodes=max_nodes))
    members = rules.members()
    why = f"resized to {min_nodes}:{max_nodes} by operator"
    if job.round is not None:
        extra = job.waiting or job.spares
        if len(members) > max_nodes or len(members) < min_nodes or (extra and len(members) < max_nodes):
            rules.form_round(now, why, RoundCause.RESIZED)
        elif job.waiting:      # already at the new max: newcomers become spares, no round to form
            places.seat(job, (), [], job.waiting + job.spares)
            job.last_call_deadline = job.forming_since = None
    elif job.awaited and len(job.places) <= max_nodes:
        # members restarting are awaited: their return (or the wait's end) forms the round; a job that was short
        # of nodes and is not at the new size resumes that wait (JobRules.grow)
        rules.grow(now)
    elif len(job.waiting) + len(job.spares) >= min_nodes:
        rules.form_round(now, why, RoundCause.RESIZED)
