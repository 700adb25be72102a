"""What the server does with training progress: each node's note (on its polls and reports) feeds the job's goodput
(goodput.py) and the nodes' paces (slow.py); each stall report may show a hang (hangs.py), which fails the round
with the culprit rank as its root cause. A report speaks only for its sender's own ranks of the running round.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from protocol.errors import ErrorCode
from protocol.messages import ProgressNote, RankState, StallReport, WorkerFailure
from rdzv_server.core import credentials, goodput, hangs, leases, operator_rules, reports
from rdzv_server.core.errors import RendezvousError
from rdzv_server.core.events import EventKind, RoundCause
from rdzv_server.core.job_rules import JobRules
from rdzv_server.core.payloads import HangDetected, RankWas
from rdzv_server.core.records import NodeRecord
from rdzv_server.core.rounds import assignment
from rdzv_server.core.slow import SLOW_GAP, SLOW_NOTES, SLOW_STEPS, NodePace, Paces


@dataclass
class JobWatch:
    """Per job, memory only: the running round's stall reports and its members' paces."""
    board: hangs.StallBoard = field(default_factory=lambda: hangs.StallBoard(-1))
    paces: Paces = field(default_factory=Paces)
    round_id: int = -1       # the round the paces are of


def noted(rules: JobRules, watch: JobWatch, node_id: str, note: ProgressNote | None, now: float) -> None:
    """A node's progress note (already authenticated with its request)."""
    job = rules.job
    if note is None or job.round is None or node_id not in job.round.members:
        return
    goodput.note(job.progress, node_id, note, job.round.round_id, now)
    if note.round_id != job.round.round_id:
        return
    if watch.round_id != job.round.round_id:     # a new round (or a new server): measured afresh, its members'
        watch.round_id = job.round.round_id      # marks kept (a pace of the last round is no peer's measure)
        watch.paces = Paces({n: NodePace(slow=p.slow) for n, p in watch.paces.nodes.items()
                             if n in job.round.members})
        job.progress.slow = watch.paces.slow()
    named = watch.paces.note(node_id, note, now)
    if named is None:
        return
    pace = watch.paces.nodes[node_id]
    job.progress.slow = watch.paces.slow()
    if not named:
        rules.record(now, EventKind.NODE_PACE_OK, f"node {node_id} keeps pace again", node_id, job.round.round_id)
        rules.node_changed(node_id)
        return
    why = (f"node {node_id} is slow: the other nodes wait {pace.gap:.0%} more of each step than it does "
           f"(at least {SLOW_GAP:.0%}, over {SLOW_STEPS}+ steps and {SLOW_NOTES} notes)")
    rules.record(now, EventKind.NODE_SLOW, why, node_id, job.round.round_id)
    rules.node_changed(node_id)
    if job.config.replace_slow_nodes and job.spares and node_id not in job.drained:
        operator_rules.drain(rules, node_id, f"replaced as slow: {why}", now, by="the server (--replace-slow-nodes)")


def stalled(rules: JobRules, watch: JobWatch, req: StallReport, now: float) -> str:
    """A node's stall report; returns why it was not acted on ("" when it was taken)."""
    job = rules.job
    node = rules.node(req.node_id)
    credentials.verify(node, req.credential)        # first: a forger learns nothing of the node
    _check_ranks(rules, node, req)
    credentials.proven(node)
    leases.renew(job, node, now)
    why_not = reports.not_running(rules, node, req.round_id)
    if why_not:
        return why_not
    if not job.config.hang_detection:
        return "hang detection is off for this job"
    if watch.board.round_id != req.round_id:
        watch.board = hangs.StallBoard(req.round_id)
    watch.board.reports[node.node_id] = (now, req)
    assert job.round is not None
    finished = {n: _ranks_of(rules, n) for n in job.round.members if n in job.successes}
    running = [n for n in job.round.members if n not in job.successes]
    hang = hangs.decide(watch.board, running, finished, job.config.hang_timeout_s, now)
    if hang is not None:
        _fail_for(rules, watch, hang, req.round_id, now)
    return ""


def _check_ranks(rules: JobRules, node: NodeRecord, req: StallReport) -> None:
    """A report names only the sender's own ranks, as the round assigned them."""
    a = assignment(rules.job.round, node.node_id) if rules.job.round is not None else None
    if a is None or a.round_id != req.round_id:
        return          # not this round's member: not_running says so
    own = range(a.rank_offset, a.rank_offset + a.local_world_size)
    wrong = [r.rank for r in req.ranks if r.rank not in own or r.local_rank != r.rank - a.rank_offset]
    if wrong:
        raise RendezvousError(ErrorCode.BAD_REQUEST, f"the report names rank(s) {wrong[:5]}, but node "
                              f"{node.node_id} runs ranks {own.start}..{own.stop - 1} in round {a.round_id}")


def _ranks_of(rules: JobRules, node_id: str) -> list[int]:
    a = assignment(rules.job.round, node_id) if rules.job.round is not None else None
    return [] if a is None else list(range(a.rank_offset, a.rank_offset + a.local_world_size))


def _fail_for(rules: JobRules, watch: JobWatch, hang: hangs.Hang, round_id: int, now: float) -> None:
    job = rules.job
    c = hang.culprit
    node = job.nodes[hang.node_id]
    rules.record(now, EventKind.HANG_DETECTED, f"hang in round {round_id}: {hang.message}", hang.node_id, round_id,
                 HangDetected(culprit=c.rank, capped=hang.capped, ranks=[
                     RankWas(rank=r.rank, node_id=n, state=r.state.value, stalled_s=r.stalled_s, where=r.where,
                             stack=r.stack) for n, r in hang.seen]))
    failure = WorkerFailure(local_rank=c.local_rank, rank=c.rank, exitcode=c.exitcode or 0, reason="hang",
                            message=hang.message[:4096], timestamp=now, host=node.host, node_id=node.node_id,
                            traceback=c.stack if c.state != RankState.EXITED else "")
    watch.board = hangs.StallBoard(-1)
    reports.fail_round(rules, node, round_id, [failure], now, RoundCause.HANG)
