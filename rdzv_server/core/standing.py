"""Where a node and its job stand, as the node sees it (node_status, in every reply and pushed view); when the
core must look again (deadlines); one line per failed worker (describe). Pure."""
from __future__ import annotations

from collections.abc import Iterable

from protocol.messages import FailureReason, JobState, NodeState, NodeStatus, WorkerFailure
from protocol.notes import SourceStep
from protocol.quoting import one_line
from rdzv_server.core.records import JobRecord, RoundRecord
from rdzv_server.core.rounds import PREPARE_LIMIT_S, assignment, copy_addr, master_of, place_of


def deadlines(job: JobRecord) -> Iterable[float]:
    for n in job.nodes.values():
        if n.holding == 0:                      # held: no lease runs
            yield n.lease_expires
        if not n.ready and not n.preparing_said:
            yield n.preparing_since + PREPARE_LIMIT_S
    yield from (job.nodes[n].excluded_until for n in job.excluded)
    if job.last_call_deadline is not None:
        yield job.last_call_deadline
    if job.state == JobState.WAITING and job.last_call_deadline is None and job.join_deadline is not None:
        yield job.join_deadline     # a pending last call forms a round: the join timeout waits for it
    if job.swap is not None:
        yield job.swap.until
    if job.alone_held is not None:
        yield job.alone_held.until


def node_status(job: JobRecord, node_id: str, now: float, *, accepted: bool = True, reason: str = "") -> NodeStatus:
    """Where `node_id` stands in its job; built fresh (assignments and failures in it are frozen).
    Called for every subscriber of a job in a fan-out: kept lean."""
    node, r, finished = job.nodes.get(node_id), job.round, job.state.finished
    state = node.state if node is not None and not finished else NodeState.GONE
    if state == NodeState.GONE and not finished and not reason and node_id in job.drained:
        # a drain that formed no round (a spare's, a waiting node's) left the job's reason older news: say the drain
        reason = f"node {node_id} drained by operator: {job.drained[node_id]}"
    status = NodeStatus(job_id=job.job_id, job_state=job.state, node_state=state,
                        round_id=r.round_id if r is not None else -1, restart_count=job.restart_count,
                        accepted=accepted, reason=reason or job.reason,
                        lease_timeout_s=job.config.lease_timeout_s,
                        checks_due=node is not None and node.checks_due and not finished,
                        hold_at_snapshot=_holds(job) and state == NodeState.MEMBER and not finished,
                        writes_end_round=job.writes_end_round)
    if finished:
        status.root_cause = job.root_cause if job.state == JobState.FAILED else None
    if r is not None and state == NodeState.MEMBER and not finished and r.awaits_port:   # store_port.py
        status.node_state = NodeState.WAITING
        status.reason = reason or f"round {r.round_id} waits for a new store port from its group rank 0 " \
                                  f"({master_of(r)})"
    elif r is not None and (finished or state == NodeState.MEMBER):
        status.assignment = assignment(r, node_id)
        status.copies_floor = job.copies_floor if not finished else -1
        status.held_floor = job.held_floor if not finished else -1
        status.moved_landed = moved_landed(job, r, node_id) if r.copies_moving and not finished else ()
    elif state == NodeState.SPARE:
        status.spare_position = job.spares.index(node_id)
    elif state == NodeState.EXCLUDED and node is not None:
        status.excluded_for_s = max(0.0, node.excluded_until - now)
    elif node is None and r is None and node_id in job.places and not finished:
        status.place_kept_s = place_kept_s(job, node_id, now)
    if r is None and job.left_steps and not finished:
        status.sources_noted = sources_noted(job, node_id)
    return status


def moved_landed(job: JobRecord, r: RoundRecord, node_id: str) -> tuple[str, ...]:
    """Of round `r`'s moving members whose old copy `node_id` holds (JobRecord.copies_moving), those whose own note
    says their copy landed at a holder of `r` (NodeStatus.moved_landed): until then the old copy is their only one
    off their host, and stays (a review: dropped for a source's push as the round began, the member lost before its
    new copy landed, and every rank went back to step 0). A fan-out calls it for every member: the holders' index
    is built once a round (O(moving)), then O(replicas) per member held."""
    held: dict[str, list[str]] | None = r.__dict__.get("moved_held")
    if held is None:
        held = r.__dict__["moved_held"] = {}
        for m in r.copies_moving:
            for h in (old.holders if (old := job.copies_moving.get(m)) is not None else ()):
                held.setdefault(h, []).append(m)
    return tuple(m for m in held.get(node_id, ()) if _landed(job, r, m))


def _landed(job: JobRecord, r: RoundRecord, node_id: str) -> bool:
    c = job.nodes[node_id].copies if node_id in job.nodes else None
    place = place_of(r, node_id)
    return c is not None and c.copied_step >= 0 and bool(c.holder) and place is not None and \
        c.holder in {copy_addr(r, h) for h in place.holders}


def sources_noted(job: JobRecord, node_id: str) -> tuple[SourceStep, ...]:
    """The last round's members gone since whose copies `node_id` held there, each with the step its own last note
    told (NodeStatus.sources_noted): a node's word on its own steps, never another's. O(gone), not O(members)."""
    return tuple(SourceStep(node_id=gone, step=step) for gone, step in job.left_steps.items()
                 if (place := job.place_copies.get(gone)) is not None and node_id in place.holders)


def place_kept_s(job: JobRecord, node_id: str, now: float) -> float:
    """How much longer, at most, the job, waiting, keeps the place of `node_id` (gone, one of the last round's) for its
    next agent: below min_nodes without it, as long as the job waits for nodes (its join timeout; a newcomer may
    take it first); else to the end of the wait for it (awaited: awaiting.py). 0 where a round may form without it:
    others awaited (their return forms it), or enough nodes ready (a last call's end forms it)."""
    ready = len(job.waiting) - job.waiting_preparing
    if job.last_call_deadline is None and ready < job.config.min_nodes:
        until = job.join_deadline
    else:
        until = job.last_call_deadline if node_id in job.awaited else None
    return max(0.0, until - now) if until is not None else 0.0


def describe(f: WorkerFailure) -> str:
    """One line for a failed worker: rank, host, how it ended, its message (line breaks escaped: the
    line becomes the job's reason, which agents print and refusals quote)."""
    how = f"signal {f.signal}" if f.signal else f"exit code {f.exitcode}"
    what = f.reason if f.reason == FailureReason.HANG else f"{f.reason}, {how}" \
        if f.reason and f.reason != FailureReason.EXITED else how
    text = f"rank {f.rank} (local {f.local_rank}) on {f.host or f.node_id}: {what}"
    return f"{text}: {one_line(f.message)}" if f.message else text


def last_failed(job: JobRecord) -> str:
    """The job's last worker failure, for an end that is not about failures (a join timeout after a node whose
    workers failed left): "" when there was none."""
    f = job.last_failure
    return f"; last failure: {describe(f)} on node {f.node_id}" if f is not None else ""


def _holds(job: JobRecord) -> bool:
    """Whether the round's ranks wait after their next snapshot for a swap: one due in this round, or a drain's, which
    carries over to any round its node is a member of (swaps._due)."""
    swap, r = job.swap, job.round
    return swap is not None and r is not None and (swap.round_id == r.round_id or
                                                   swap.drain and swap.node_id in r.members)
