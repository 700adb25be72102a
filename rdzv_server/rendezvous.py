"""The rendezvous core: every rule about rounds, leases, restarts, spares and exclusions.

Theory of operation
-------------------
A job is a sequence of rounds. A round is one agreed fact: the ordered list of member nodes, and
for each its group rank, global rank offset, the world size, the master address and the job-wide
restart count. Nodes outside the round are *waiting* (admitted for the next round), *spare*
(the job is at max: promoted when a member goes) or *excluded* (failed too often: cooling down).

The next round is formed by `_form_round`, from (live members in their old order) + waiting +
spares, capped at max_nodes. That keeps ranks stable: rank 0 stays rank 0 while it lives.
What triggers it:
- the first round: at max nodes at once; at >= min nodes when the last-call window ends;
- a worker failure of the running round: at once, restart count + 1 (job FAILED past the budget);
- a member lost (lease expired, connection dropped) or leaving: at once, no budget consumed;
  below min the job goes back to waiting for nodes until join_timeout;
- a newcomer while running below max: after the last-call window, or at once when it fills max.

Every method takes `now` (seconds, any monotonic-enough clock) and does no I/O. A request that
cannot be obeyed raises `RendezvousError` before anything changes. Each decision records an
`Event` with its reason and bumps the job's `epoch` when some node's view of the round changed,
which is the shell's cue to wake long-polls. `next_deadline()` tells the shell when to `tick()`.
"""
from __future__ import annotations


import msgspec

from protocol.errors import ErrorCode
from protocol.messages import (
    FailureReport,
    JobState,
    JoinRequest,
    LeaveRequest,
    NodeState,
    NodeStatus,
    PollRequest,
    SuccessReport,
    WorkerFailure,
)
from rdzv_server.errors import RendezvousError
from rdzv_server.operator_rules import OperatorRules
from rdzv_server.records import Event, JobRecord, NodeRecord
from rdzv_server.rounds import build_round
from rdzv_server.rounds import candidates, count_nodes, deadlines, growth_cause

# After a long-poll's connection closes, the node has this long (capped by its lease) to reconnect.
DROP_GRACE_S = 1.0
# A finished job's id may start a new run this long after it finished (its agents have exited by
# then: they leave as soon as they see the end). Sooner, a join is refused as late for that run.
REUSE_FINISHED_AFTER_S = 10.0


class Rendezvous(OperatorRules):
    """All jobs of one server. Not thread-safe: one event loop drives it."""

    def __init__(self, jobs: dict[str, JobRecord] | None = None) -> None:
        self.jobs: dict[str, JobRecord] = jobs if jobs is not None else {}

    # ---- requests -------------------------------------------------------------------------

    def join(self, job_id: str, req: JoinRequest, now: float) -> NodeStatus:
        job = self.jobs.get(job_id)
        previous = None
        if job is not None and job.state.finished and job.finished_at is not None \
                and now - job.finished_at >= REUSE_FINISHED_AFTER_S:
            previous, job = job, None
        if job is None:
            job = JobRecord(job_id=job_id, config=req.config, state=JobState.WAITING, created_at=now,
                            join_deadline=now + req.config.join_timeout_s)
            self.jobs[job_id] = job
            c = req.config
            _event(job, now, "job_created",
                   f"job created by {req.node_id}: nodes {c.min_nodes}:{c.max_nodes}, "
                   f"max_restarts {c.max_restarts}", req.node_id)
            if previous is not None:
                _event(job, now, "job_reused", f"job id reused: the previous run {previous.state.value} "
                       f"({previous.reason})")
        elif job.state.finished:
            raise RendezvousError(ErrorCode.JOB_FINISHED,
                                  f"job {job_id!r} has already {job.state.value}: {job.reason}")
        else:
            diffs = (job.join_config or job.config).differences(req.config)
            if diffs:
                raise RendezvousError(ErrorCode.CONFIG_CONFLICT,
                                      f"job {job_id!r} exists with another config: " + "; ".join(diffs))
        if req.node_id in job.drained:
            raise RendezvousError(ErrorCode.NODE_DRAINED, f"node {req.node_id} was drained from job {job_id!r} "
                                  f"by the operator ({job.drained[req.node_id]})")
        existing = job.nodes.get(req.node_id)
        if existing is not None and existing.instance == req.instance:
            existing.addr, existing.master_port = req.addr, req.master_port or existing.master_port
            _renew(job, existing, now)
            return self.view(job_id, req.node_id, now)
        if existing is not None:
            self._remove(job, existing, now, "node_lost", f"node {req.node_id} restarted (new agent instance)",
                         failed_at=existing.last_seen)
        node = NodeRecord(node_id=req.node_id, instance=req.instance, addr=req.addr, host=req.host or req.addr,
                          role=req.role, local_world_size=req.local_world_size, master_port=req.master_port,
                          state=NodeState.WAITING, joined_at=now, last_seen=now,
                          lease_expires=now + job.config.lease_timeout_s)
        if existing is not None:
            # Same node, new agent: its failure history and any exclusion stay with the node id, so
            # restarting the agent does not cut a cooldown short.
            node.failure_times, node.exclusions = existing.failure_times, existing.exclusions
            node.excluded_until = existing.excluded_until
        job.nodes[node.node_id] = node
        _event(job, now, "node_joined", f"node {node.node_id} joined from {node.addr} "
               f"with {node.local_world_size} workers", node.node_id)
        if node.excluded_until > now:
            node.state = NodeState.EXCLUDED
            job.excluded.append(node.node_id)
            _event(job, now, "node_excluded", f"node {node.node_id} stays excluded for "
                   f"{node.excluded_until - now:g}s (its agent restarted)", node.node_id)
        else:
            self._admit(job, node, now)
        return self.view(job_id, req.node_id, now)

    def poll(self, job_id: str, req: PollRequest, now: float) -> NodeStatus:
        job = self._job(job_id)
        node = job.nodes.get(req.node_id)
        if node is not None:
            if req.master_port:
                node.master_port = req.master_port
            _renew(job, node, now)
        return self.view(job_id, req.node_id, now)

    def report_failure(self, job_id: str, req: FailureReport, now: float) -> NodeStatus:
        job = self._job(job_id)
        node = self._node(job, req.node_id)
        _renew(job, node, now)
        failures = sorted((_stamp(f, node, now) for f in req.failures), key=lambda f: f.timestamp)
        stale = self._stale(job, node, req.round_id)
        if stale:
            # A late report on the round that just failed may hold the earlier failure: keep the
            # job-wide root cause the first failure in time, but do not count it again.
            if not job.state.finished and req.round_id == job.root_cause_round and job.root_cause is not None \
                    and failures[0].timestamp < job.root_cause.timestamp:
                job.root_cause = failures[0]
            return self.view(job_id, node.node_id, now, accepted=False, reason=stale)
        # A member whose connection just dropped (or whose lease ran out before the next tick) is
        # the likelier cause: its loss comes first, and this failure (a peer's collective breaking)
        # then belongs to a round that no longer runs.
        suspects = [n for n in self._members(job) if n != node.node_id
                    and (job.nodes[n].dropped or job.nodes[n].lease_expires <= now)]
        if suspects:
            for nid in suspects:
                self._lose(job, job.nodes[nid], now, "its connection closed" if job.nodes[nid].dropped
                           else f"no contact for {now - job.nodes[nid].last_seen:.1f}s")
            return self.view(job_id, node.node_id, now, accepted=False,
                             reason=f"failure attributed to the loss of {', '.join(suspects)}")
        first = failures[0]
        job.root_cause, job.root_cause_round, job.last_failure = first, req.round_id, first
        job.restart_count += 1
        for f in failures:
            _event(job, now, "worker_failed", _describe(f), node.node_id, req.round_id,
                   {"rank": f.rank, "local_rank": f.local_rank, "exitcode": f.exitcode, "signal": f.signal,
                    "reason": f.reason, "host": f.host, "message": f.message})
        node.failure_times = [t for t in node.failure_times if t > now - job.config.exclude_window_s] + [now]
        if job.restart_count > job.config.max_restarts:
            self._finish(job, now, JobState.FAILED,
                         f"worker failures exceeded max_restarts={job.config.max_restarts}; "
                         f"root cause: {_describe(job.root_cause or first)}")
            return self.view(job_id, node.node_id, now)
        why = f"worker failure on {node.node_id} ({_describe(first)}); restart {job.restart_count}" \
              f"/{job.config.max_restarts}"
        cfg = job.config
        if cfg.exclude_after and len(node.failure_times) >= cfg.exclude_after:
            self._exclude(job, node, now)
        self._form_round(job, now, why, "failure", failed_at=first.timestamp)
        return self.view(job_id, node.node_id, now)

    def report_success(self, job_id: str, req: SuccessReport, now: float) -> NodeStatus:
        job = self._job(job_id)
        node = self._node(job, req.node_id)
        _renew(job, node, now)
        stale = self._stale(job, node, req.round_id)
        if stale:
            return self.view(job_id, node.node_id, now, accepted=False, reason=stale)
        if node.node_id not in job.successes:
            job.successes.append(node.node_id)
            _event(job, now, "node_succeeded", f"node {node.node_id} finished round {req.round_id}",
                   node.node_id, req.round_id)
        assert job.round is not None
        if set(job.round.members) <= set(job.successes):
            self._finish(job, now, JobState.SUCCEEDED,
                         f"all {len(job.round.members)} nodes of round {job.round.round_id} succeeded")
        return self.view(job_id, node.node_id, now)

    def leave(self, job_id: str, req: LeaveRequest, now: float) -> NodeStatus:
        job = self._job(job_id)
        node = job.nodes.get(req.node_id)
        if node is not None and not job.state.finished:
            self._remove(job, node, now, "node_left", f"node {node.node_id} left: {req.reason}")
        return self.view(job_id, req.node_id, now)

    def connection_dropped(self, job_id: str, node_id: str, now: float) -> None:
        """A node's long-poll connection closed under it: give it a short grace to come back."""
        job = self.jobs.get(job_id)
        node = job.nodes.get(node_id) if job else None
        if job is None or node is None or job.state.finished:
            return
        node.dropped = True
        node.lease_expires = min(node.lease_expires, now + min(DROP_GRACE_S, job.config.lease_timeout_s))

    # ---- time ----------------------------------------------------------------------------

    def tick(self, now: float) -> list[str]:
        """Apply every deadline that has passed; return the ids of the jobs that changed."""
        changed = []
        for job in self.jobs.values():
            if job.state.finished:
                continue
            before = (job.epoch, len(job.events))
            self._tick_job(job, now)
            if (job.epoch, len(job.events)) != before:
                changed.append(job.job_id)
        return changed

    def next_deadline(self) -> float | None:
        due = [d for job in self.jobs.values() if not job.state.finished for d in deadlines(job)]
        return min(due, default=None)

    def restored(self, now: float, away_s: float, clean: bool) -> None:
        """The server restarted on a saved state: nobody is blamed for the time it was away.

        Every live node gets a fresh lease plus one more lease of grace to reconnect; pending
        last-call and join deadlines move by the time away. Exclusion cooldowns keep running.
        """
        how = "after a clean shutdown" if clean else "without a clean shutdown (killed or crashed)"
        for job in self.jobs.values():
            if job.state.finished:
                continue
            grace = 2 * job.config.lease_timeout_s
            for node in job.nodes.values():
                node.dropped = False
                node.lease_expires = now + grace
            if job.last_call_deadline is not None:
                job.last_call_deadline += away_s
            if job.join_deadline is not None:
                job.join_deadline += away_s
            _event(job, now, "server_restarted", f"server restarted {how}; away about {away_s:.1f}s; "
                   f"{len(job.nodes)} node leases renewed for {grace:g}s", data={"away_s": round(away_s, 3)})

    # ---- views ---------------------------------------------------------------------------

    def view(self, job_id: str, node_id: str, now: float, *, accepted: bool = True,
             reason: str = "") -> NodeStatus:
        job = self._job(job_id)
        node = job.nodes.get(node_id)
        state = node.state if node is not None and not job.state.finished else NodeState.GONE
        status = NodeStatus(job_id=job_id, job_state=job.state, node_state=state,
                            round_id=job.round.round_id if job.round else -1, restart_count=job.restart_count,
                            accepted=accepted, reason=reason or job.reason,
                            lease_timeout_s=job.config.lease_timeout_s)
        if job.state.finished:
            status.root_cause = job.root_cause if job.state == JobState.FAILED else None
            if job.round is not None and node_id in job.round.assignments:
                status.assignment = job.round.assignments[node_id]
        elif state == NodeState.MEMBER and job.round is not None:
            status.assignment = job.round.assignments[node_id]
        elif state == NodeState.SPARE:
            status.spare_position = job.spares.index(node_id)
        elif state == NodeState.EXCLUDED and node is not None:
            status.excluded_for_s = max(0.0, node.excluded_until - now)
        return status

    # ---- rules ---------------------------------------------------------------------------

    def _tick_job(self, job: JobRecord, now: float) -> None:
        for node in [n for n in job.nodes.values() if n.lease_expires <= now]:
            why = "its connection closed" if node.dropped else \
                f"no contact for {now - node.last_seen:.1f}s (lease {job.config.lease_timeout_s:g}s)"
            self._lose(job, node, now, why)
        for nid in list(job.excluded):
            node = job.nodes[nid]
            if node.excluded_until <= now:
                job.excluded.remove(nid)
                _event(job, now, "node_readmitted", f"node {nid} finished its exclusion cooldown", nid)
                self._admit(job, node, now)
        if job.last_call_deadline is not None and job.last_call_deadline <= now:
            job.last_call_deadline = None
            self._form_round(job, now, "last call ended with " + count_nodes(candidates(job)), growth_cause(job))
        if job.state == JobState.WAITING and job.last_call_deadline is None and \
                job.join_deadline is not None and job.join_deadline <= now:
            have = len(job.waiting)
            self._finish(job, now, JobState.FAILED,
                         f"only {have} of min {job.config.min_nodes} nodes joined within "
                         f"join_timeout {job.config.join_timeout_s:g}s")

    def _admit(self, job: JobRecord, node: NodeRecord, now: float) -> None:
        """Place a newly joined (or readmitted) node: waiting for the next round, or spare."""
        cfg = job.config
        if len(self._members(job)) + len(job.waiting) < cfg.max_nodes:
            node.state = NodeState.WAITING
            job.waiting.append(node.node_id)
            if job.forming_since is None:
                job.forming_since = now
                _event(job, now, "round_opened", f"round {job.last_round_id + 1} opened by {node.node_id}: "
                       f"collecting nodes ({cfg.min_nodes}:{cfg.max_nodes})", node.node_id)
            total = len(self._members(job)) + len(job.waiting)
            if total >= cfg.max_nodes:
                self._form_round(job, now, f"max_nodes {cfg.max_nodes} reached", growth_cause(job))
            elif total >= cfg.min_nodes and job.last_call_deadline is None:
                if cfg.last_call_s <= 0:
                    self._form_round(job, now, f"{total} nodes (last call 0s)", growth_cause(job))
                else:
                    job.last_call_deadline = now + cfg.last_call_s
        else:
            node.state = NodeState.SPARE
            job.spares.append(node.node_id)
            _event(job, now, "node_spare", f"node {node.node_id} is spare #{len(job.spares)} "
                   f"(job at max_nodes {cfg.max_nodes})", node.node_id)

    def _form_round(self, job: JobRecord, now: float, why: str, cause: str,
                    failed_at: float | None = None) -> None:
        """Form the next round from live members + waiting + spares, or go back to waiting.

        `cause` is the reason's category (see CAUSES); `failed_at`, when a failure or loss caused it,
        is when that happened (worker exit, or the lost node's last contact).
        """
        cfg = job.config
        pool = candidates(job)
        chosen, rest = pool[: cfg.max_nodes], pool[cfg.max_nodes:]
        job.last_call_deadline = None
        job.successes = []
        job.epoch += 1
        if len(chosen) < cfg.min_nodes:
            if job.round is not None or job.state != JobState.WAITING:
                _event(job, now, "round_waiting", f"{why}; {count_nodes(chosen)} < min "
                       f"{cfg.min_nodes}: waiting for nodes", data={"cause": cause})
            job.round = None
            job.state = JobState.WAITING
            job.waiting, job.spares = chosen, rest
            for nid in chosen:
                job.nodes[nid].state = NodeState.WAITING
            if job.join_deadline is None:
                job.join_deadline = now + cfg.join_timeout_s
            job.reason = f"{why}; waiting for nodes"
            return
        opened = job.forming_since if job.forming_since is not None else now
        job.last_round_id += 1
        job.round = build_round(job, chosen, job.last_round_id, opened, now, why)
        job.state = JobState.RUNNING
        job.waiting, job.spares = [], rest
        for nid in chosen:
            job.nodes[nid].state = NodeState.MEMBER
        for nid in rest:
            job.nodes[nid].state = NodeState.SPARE
        job.forming_since = None
        job.join_deadline = None
        job.reason = why
        _event(job, now, "round_completed",
               f"round {job.round.round_id}: {len(chosen)} nodes, world size {job.round.world_size} ({why})",
               round_id=job.round.round_id,
               data={"nodes": len(chosen), "world_size": job.round.world_size, "reason": why, "cause": cause,
                     "formation_s": round(now - opened, 6),
                     **({"since_failure_s": round(max(0.0, now - failed_at), 6)} if failed_at else {})})

    def _lose(self, job: JobRecord, node: NodeRecord, now: float, why: str) -> None:
        self._remove(job, node, now, "node_lost", f"node {node.node_id} lost: {why}", failed_at=node.last_seen)

    def _remove(self, job: JobRecord, node: NodeRecord, now: float, kind: str, message: str,
                failed_at: float | None = None) -> None:
        was_member = node.node_id in self._members(job)
        del job.nodes[node.node_id]
        for queue in (job.waiting, job.spares, job.excluded, job.successes):
            if node.node_id in queue:
                queue.remove(node.node_id)
        job.epoch += 1
        _event(job, now, kind, message, node.node_id)
        if was_member:
            job.forming_since = now
            self._form_round(job, now, message, kind, failed_at)
        elif job.last_call_deadline is not None:
            # The window was for a round with more nodes: below min, or (while a round runs) with no
            # newcomer left, there is nothing for it to form.
            if len(self._members(job)) + len(job.waiting) < job.config.min_nodes:
                job.last_call_deadline = None
            elif job.round is not None and not job.waiting:
                job.last_call_deadline = job.forming_since = None

    def _exclude(self, job: JobRecord, node: NodeRecord, now: float) -> None:
        cfg = job.config
        cooldown = min(cfg.exclude_cooldown_s * (2 ** node.exclusions), cfg.exclude_cooldown_max_s)
        node.exclusions += 1
        node.excluded_until = now + cooldown
        node.failure_times = []
        node.state = NodeState.EXCLUDED
        for queue in (job.waiting, job.spares):
            if node.node_id in queue:
                queue.remove(node.node_id)
        job.excluded.append(node.node_id)
        if job.round is not None and node.node_id in job.round.members:
            job.round.members = [m for m in job.round.members if m != node.node_id]
        _event(job, now, "node_excluded", f"node {node.node_id} excluded for {cooldown:g}s after "
               f"{cfg.exclude_after} worker failures within {cfg.exclude_window_s:g}s", node.node_id)

    def _finish(self, job: JobRecord, now: float, state: JobState, why: str) -> None:
        job.state = state
        job.reason = why
        job.finished_at = now
        job.last_call_deadline = job.join_deadline = None
        job.epoch += 1
        _event(job, now, f"job_{state.value}", f"job {state.value}: {why}")

    def _stale(self, job: JobRecord, node: NodeRecord, round_id: int) -> str:
        if job.state.finished:
            return f"job already {job.state.value}"
        if job.round is None or job.round.round_id != round_id:
            current = job.round.round_id if job.round else "none (waiting for nodes)"
            return f"stale: report for round {round_id} but the current round is {current}"
        if node.node_id not in job.round.members:
            return f"stale: node {node.node_id} is not a member of round {round_id}"
        return ""

    def _members(self, job: JobRecord) -> list[str]:
        return list(job.round.members) if job.round is not None else []

    def _job(self, job_id: str) -> JobRecord:
        job = self.jobs.get(job_id)
        if job is None:
            raise RendezvousError(ErrorCode.UNKNOWN_JOB, f"no job {job_id!r} on this server")
        return job

    def _node(self, job: JobRecord, node_id: str) -> NodeRecord:
        node = job.nodes.get(node_id)
        if node is None:
            raise RendezvousError(ErrorCode.UNKNOWN_NODE,
                                  f"node {node_id!r} is not part of job {job.job_id!r}: join again")
        return node


def _renew(job: JobRecord, node: NodeRecord, now: float) -> None:
    node.last_seen = now
    node.dropped = False
    node.lease_expires = now + job.config.lease_timeout_s


def _stamp(f: WorkerFailure, node: NodeRecord, now: float) -> WorkerFailure:
    """A copy of `f` with the reporter's host, node id and (when missing) the arrival time."""
    return msgspec.structs.replace(f, host=f.host or node.host, node_id=node.node_id, timestamp=f.timestamp or now)


def _describe(f: WorkerFailure) -> str:
    how = f"signal {f.signal}" if f.signal else f"exit code {f.exitcode}"
    what = f"{f.reason}, {how}" if f.reason and f.reason != "exited" else how
    text = f"rank {f.rank} (local {f.local_rank}) on {f.host or f.node_id}: {what}"
    return f"{text}: {f.message}" if f.message else text


def _event(job: JobRecord, now: float, kind: str, message: str, node_id: str = "", round_id: int = -1,
           data: dict | None = None) -> None:
    job.record(Event(t=now, seq=0, kind=kind, message=message, node_id=node_id, round_id=round_id, data=data or {}))
