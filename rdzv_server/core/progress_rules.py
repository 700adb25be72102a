"""What the server does with training progress: each node's note (on its polls and reports) feeds the job's goodput
(goodput.py) and the nodes' paces (slow.py); each stall report may show a stall (hangs.py): a hang decided fails
the round with the culprit rank as its root cause; one not decided (a rank alone, a long collective) is shown
while it lasts, with an event once. A report speaks only for its sender's own ranks of the running round.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from protocol.errors import ErrorCode
from protocol.messages import FailureReason, StallReport, WorkerFailure
from protocol.notes import ProgressNote
from protocol.stalls import RankState
from rdzv_server.core import divergence, goodput, hangs, reports, swaps
from rdzv_server.core.errors import RendezvousError
from rdzv_server.core.events import EventKind, RoundCause
from rdzv_server.core.hangs import MAX_PLACES, HangPlace, Stall, StallKind, StallShown
from rdzv_server.core.job_rules import JobRules
from rdzv_server.core.payloads import HangDetected, RankWas, StallSeen
from rdzv_server.core.records import JobRecord, NodeRecord
from rdzv_server.core.rounds import assignment
from rdzv_server.core.slow import DEMAND_GAP, SLOW_GAP, SLOW_NOTES, SLOW_SPAN_S, SLOW_STEPS, NodePace, Paces

# Said once when a job that swaps slow nodes runs its collectives on GPUs (a node's note says `on_device`).
UNSEEN_ON_DEVICE = ("slow nodes are named from how long the workers' host waits in backward and collectives; this "
                    "job's collectives run on its GPUs (NCCL), which the host does not wait in, so a node slow on its "
                    "GPU is not named and --replace-slow-nodes does not swap it (a node slow on its CPU side, its data "
                    "loading, may be)")


@dataclass
class LiveRound:
    """Per job, memory only: the running round's stall reports and its members' paces."""
    board: hangs.StallBoard = field(default_factory=lambda: hangs.StallBoard(-1))
    paces: Paces = field(default_factory=Paces)
    round_id: int = -1       # the round the paces are of
    said: set[tuple[object, ...]] = field(default_factory=set)   # the board's round's stalls given an event
    unseen_said: bool = False    # PACE_UNSEEN was said (once per job)
    digests: divergence.Digests = field(default_factory=divergence.Digests)   # the round's replicas (divergence.py)


def noted(rules: JobRules, live: LiveRound, node_id: str, note: ProgressNote | None, now: float) -> None:
    """A node's progress note (already authenticated with its request)."""
    job = rules.job
    if note is None or job.round is None or node_id not in job.round.members:
        return
    ended = goodput.note(job.progress, node_id, note, job.round.round_id, now)
    if note.round_id != job.round.round_id:
        return
    if ended is not None and ended.redone > 0:      # work lost to the restart: said, whatever its cause
        rules.record(now, EventKind.WORK_REDONE, f"round {job.round.round_id} resumed from step "
                     f"{job.progress.round_resumed} after the job had reached step {job.progress.reached}: "
                     f"{ended.redone} step(s) are trained again", "", job.round.round_id)
    if note.on_device and job.config.replace_slow_nodes and not live.unseen_said:
        live.unseen_said = True
        rules.record(now, EventKind.PACE_UNSEEN, UNSEEN_ON_DEVICE, node_id, job.round.round_id)
    if note.digests:
        own = set(_ranks_of(rules, node_id))
        told = [d for d in note.digests if d.rank in own]     # its own ranks only
        verdict = divergence.note(live.digests, job.round.round_id, job.round.world_size, told, node_id)
        job.progress.alike_step = max(job.progress.alike_step, live.digests.agreed)
        if live.digests.groups:     # the newest judgement: a mesh grown from one shard to two holds shards since
            job.progress.all_alike = live.digests.groups == 1
        if verdict is not None:
            _diverged(rules, verdict, now)
            return
    if live.round_id != job.round.round_id:     # a new round (or a new server): measured afresh, its members'
        live.round_id = job.round.round_id      # marks kept (a pace of the last round is no peer's measure)
        live.paces = Paces({n: NodePace(slow=p.slow) for n, p in live.paces.nodes.items()
                             if n in job.round.members})
        job.progress.slow = live.paces.slow()
    if note.held_step >= 0:
        swaps.held(rules, node_id, note.held_step, now)
    named = live.paces.note(node_id, note, now)
    if named is None:
        if node_id in job.progress.slow and job.config.replace_slow_nodes and job.swap is None:
            swaps.ask(rules, node_id, _why_slow(node_id, live.paces.nodes[node_id]), now)   # a spare came since
        return
    pace = live.paces.nodes[node_id]
    job.progress.slow = live.paces.slow()
    if not named:
        rules.record(now, EventKind.NODE_PACE_OK, f"node {node_id} keeps pace again{swaps.call_off(rules, node_id)}",
                     node_id, job.round.round_id)
        rules.node_changed(node_id)
        return
    why = _why_slow(node_id, pace)
    rules.record(now, EventKind.NODE_SLOW, why, node_id, job.round.round_id)
    rules.node_changed(node_id)
    if job.config.replace_slow_nodes:
        swaps.ask(rules, node_id, why, now, named=True)


def _why_slow(node_id: str, pace: NodePace) -> str:
    how = "on it in backward and collectives" if pace.measured else "by CPU demand"
    return (f"node {node_id} is slow: the other nodes wait {pace.gap:.0%} more of each step than it does, {how} "
            f"(at least {SLOW_GAP if pace.measured else DEMAND_GAP:.0%}, over {SLOW_STEPS}+ steps and "
            f"{SLOW_NOTES} notes in {SLOW_SPAN_S:.0f}+ s)")


def stalled(rules: JobRules, live: LiveRound, node: NodeRecord, req: StallReport, now: float) -> str:
    """An authenticated node's stall report (requests.py); returns why it was not acted on ("" when it was taken)."""
    job = rules.job
    why_not = reports.not_running(rules, node, req.round_id)
    if why_not:
        return why_not
    if not job.config.hang_detection:
        return "hang detection is off for this job"
    if live.board.round_id != req.round_id:
        live.board, live.said = hangs.StallBoard(req.round_id), set()
    live.board.reports[node.node_id] = (now, req)
    assert job.round is not None
    finished = {n: _ranks_of(rules, n) for n in job.round.members if n in job.successes}
    running = [n for n in job.round.members if n not in job.successes]
    steps = job.progress.round_steps if job.progress.round_id == req.round_id else 0
    stall = hangs.assess(live.board, running, finished, job.config, {p.place for p in job.hang_places}, now, steps)
    if stall is not None and stall.decided:
        _fail_for(rules, live, stall, req.round_id, now)
    elif stall is not None:
        _show(rules, live, stall, req, steps, now)
    return ""


def shown_stall(job: JobRecord, now: float) -> StallShown | None:
    """The stall shown now: of the running round, its reports fresh, and no step since."""
    s = job.stall
    if s is None or job.round is None or s.round_id != job.round.round_id or now > s.fresh_until:
        return None
    return s if job.progress.round_id != s.round_id or job.progress.round_steps <= s.steps else None


def _show(rules: JobRules, live: LiveRound, stall: Stall, req: StallReport, steps: int, now: float) -> None:
    """A stall not decided: shown while it lasts, and said once per spell (and rank) in the history."""
    job = rules.job
    if shown_stall(job, now) is None:       # a new spell: the job stepped since the last one
        live.said.clear()
    # its ranks' own steps count (the notes may lag them): once the job steps past them, the stall is over
    steps = max([steps, *(r.steps for _, r in stall.seen)])
    fresh_s = max(hangs.FRESH_MIN_S, hangs.FRESH_THRESHOLDS * req.threshold_s)
    job.stall = msgspec.structs.replace(stall.shown(now), round_id=req.round_id, steps=steps,
                                        fresh_until=now + fresh_s)
    key = (req.round_id, stall.kind, stall.culprit.rank, stall.excused)    # not the place: a loop's line moves
    if key in live.said:
        return
    live.said.add(key)
    c, line = stall.culprit, job.stall.line(now)
    limit = (f"a hang only after {stall.limit_s:.0f}s ({_flag(stall.kind)})" if stall.limit_s > 0
             else f"never a hang ({_flag(stall.kind)} 0)")
    before = next((p for p in job.hang_places if hangs.same_place(p.place, stall.place)), None)
    if stall.excused and before is not None:
        kind = EventKind.HANG_EXCUSED
        message = (f"{line}: the job was restarted for a hang at this place in round {before.round_id}, so it is "
                   f"taken as working and never decided a hang there again")
    else:
        kind = EventKind.RANKS_ALONE if stall.kind is StallKind.ALONE else EventKind.LONG_COLLECTIVE
        # a rank alone is shown, not judged: say what it was seen doing (a rank asleep for ever is quiet, not working)
        state = f"rank {c.rank} {c.state.value} (shown, not judged)" if stall.kind is StallKind.ALONE else "not hung"
        message = f"{line}: {state}; {limit}"
    rules.record(now, kind, message, stall.node_id, req.round_id, StallSeen(
        kind=stall.kind.value, culprit=c.rank, stalled_s=round(stall.spell_s, 3), limit_s=stall.limit_s,
        place=stall.place, ranks=_ranks_was(stall), excused_round=before.round_id if before else -1))


def _flag(kind: StallKind) -> str:
    return "--hang-alone-timeout" if kind is StallKind.ALONE else "--hang-timeout"


def check_ranks(rules: JobRules, node: NodeRecord, req: StallReport) -> None:
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


def _fail_for(rules: JobRules, live: LiveRound, stall: Stall, round_id: int, now: float) -> None:
    job = rules.job
    c = stall.culprit
    node = job.nodes[stall.node_id]
    message = stall.message
    rules.record(now, EventKind.HANG_DETECTED, f"hang in round {round_id}: {message}", stall.node_id, round_id,
                 HangDetected(culprit=c.rank, capped=stall.capped, ranks=_ranks_was(stall), kind=stall.kind.value,
                              limit_s=stall.limit_s if stall.capped else 0.0, odd=[r.rank for r in stall.odd]))
    if stall.capped:       # a limit may be wrong: never decided at this place again in this job
        job.hang_places = [*job.hang_places, HangPlace(place=stall.place, round_id=round_id, rank=c.rank)
                           ][-MAX_PLACES:]
    failure = WorkerFailure(local_rank=c.local_rank, rank=c.rank, exitcode=c.exitcode or 0,
                            reason=FailureReason.HANG.value,
                            message=message[:4096], timestamp=now, host=node.host, node_id=node.node_id,
                            traceback=c.stack if c.state != RankState.EXITED else "")
    live.board, live.said, job.stall = hangs.StallBoard(-1), set(), None
    reports.fail_round(rules, node, round_id, [failure], now, RoundCause.HANG)


def _diverged(rules: JobRules, v: divergence.Diverged, now: float) -> None:
    """Replicas diverged at a step: said, the next round told to resume at most from the agreed step, and the
    round failed for the first odd rank (its node a suspect), else for the round's first member."""
    job = rules.job
    assert job.round is not None
    round_id = job.round.round_id
    job.resume_at_most = v.agreed if v.agreed >= 0 else max(0, v.step - 1)
    text = divergence.line(v)
    culprit = v.odd[0] if v.odd else 0
    node_id = next((n for n in job.round.members if culprit in _ranks_of(rules, n)), job.round.members[0])
    rules.record(now, EventKind.REPLICAS_DIVERGED, text, node_id if v.odd else "", round_id)
    node = job.nodes[node_id]
    offset = _ranks_of(rules, node_id)[0] if _ranks_of(rules, node_id) else 0
    failure = WorkerFailure(local_rank=culprit - offset if v.odd else 0, rank=culprit, exitcode=0,
                            reason=FailureReason.DIVERGED.value, message=text[:4096], timestamp=now,
                            host=node.host, node_id=node_id)
    reports.fail_round(rules, node, round_id, [failure], now, RoundCause.DIVERGED, blamed=bool(v.odd))


def _ranks_was(stall: Stall) -> list[RankWas]:
    return [RankWas(rank=r.rank, node_id=n, state=r.state.value, stalled_s=r.stalled_s, where=r.where, stack=r.stack,
                    call=r.call, io_bytes=r.io_bytes, process_cpu=r.process_cpu, gpu_busy=r.gpu_busy)
            for n, r in stall.seen]
