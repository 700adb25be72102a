"""The rendezvous core: every job of one server, and what happens across them.

This registry creates jobs, reuses finished ids, routes each request to its job's rules (`job_rules.py`,
`operator_rules.py`), ticks deadlines and re-arms everything after a restart; each call's effects go to `outbox`.
Every method takes `now` and does no I/O. The rules only compare and subtract times, so any clock works while one
core is driven by one clock; the server (and `node-agent --standalone`) passes wall time (coordinator.py says why).
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Iterator
from contextlib import contextmanager

from protocol.errors import ErrorCode, unknown_job
from protocol.messages import AgentRequest, JobConfig, JobState, JoinRequest, NodeStatus
from rdzv_server.core import admission, credentials, gone_nodes, operator_rules, reports, requests, swaps
from rdzv_server.core.errors import RendezvousError
from rdzv_server.core.events import EventKind
from rdzv_server.core.job_rules import JobRules
from rdzv_server.core.leases import DOUBT_QUIET_S, OUTAGE_LIMIT_S, QUIET_S, Hearing, ReturnWave, extend
from rdzv_server.core.limits import Limits, node_room
from rdzv_server.core.outbox import Outbox
from rdzv_server.core.progress_rules import LiveRound
from rdzv_server.core.records import JobRecord
from rdzv_server.core.requests import ARRIVED, Arrival
from rdzv_server.core.standing import deadlines, node_status
from rdzv_server.core.unhealthy import UnhealthyHosts

__all__ = ["REUSE_FINISHED_AFTER_S", "Limits", "Rendezvous", "RendezvousError"]

# A finished job's id starts a new run at once, except for an agent of that run (same instance) joining within
# this long: it is late and refused (after it, that run's agents have exited).
REUSE_FINISHED_AFTER_S = 10.0


class Rendezvous:
    """All jobs of one server. Not thread-safe: one event loop drives it."""

    def __init__(self, jobs: dict[str, JobRecord] | None = None, limits: Limits | None = None) -> None:
        self.jobs: dict[str, JobRecord] = jobs if jobs is not None else {}
        self.limits = limits or Limits()
        self.outbox = Outbox()
        self.node_count = sum(len(j.nodes) for j in self.jobs.values())
        self.heard_at: float | None = None   # the last agent request of any job (None: none yet)
        self.unhealthy = UnhealthyHosts(self.limits.unhealthy_hold_s)   # hosts kept out of every job
        self._quiet_noted: set[str] = set()   # jobs told of the server's silence since it last heard
        self.silence: tuple[float, float] | None = None   # the last silence of DOUBT_QUIET_S or more that ended
        self._waves: dict[str, ReturnWave] = {}            # per job: its nodes coming back since that silence
        self.live_rounds: dict[str, LiveRound] = {}       # per job: stall reports, nodes' paces (memory only)
        # Finished jobs by end time, a heap: forgetting one is never a scan; stale entries are skipped.
        self._ended: list[tuple[float, str]] = [(j.finished_at or 0.0, j.job_id) for j in self.jobs.values()
                                                if j.state.finished]
        heapq.heapify(self._ended)

    def heard(self, now: float) -> None:
        """Some agent's path to the server worked at `now` (a request, or a held poll answered a keepalive probe)."""
        if self.heard_at is None or now > self.heard_at:
            if self.heard_at is not None and now - self.heard_at >= DOUBT_QUIET_S:
                self.silence = (self.heard_at, now)   # maybe the server's own link: leases.grace_after_silence
                self._waves.clear()
            self.heard_at = now
            self._quiet_noted.clear()

    def take_effects(self) -> Outbox:
        """What the calls since the last take did (see outbox.py)."""
        self._note_ended()
        for job, _ in self.outbox.events:      # a job that just ended is due to be forgotten in time
            if job.state.finished and job.finished_at is not None:
                self.outbox.deadline(self._forget_at(job.finished_at))
        return self.outbox.drain()

    # ---- requests (requests.py: the pipeline's steps and each kind's rule) ------------------

    def handle(self, job_id: str, req: AgentRequest, now: float, arrival: Arrival = ARRIVED) -> NodeStatus:
        """One agent request, of any kind: the job and node found, heard, authenticated, its lease renewed and its
        progress noted, once for every kind (requests.py); then the kind's rule; the node's view in reply."""
        self.heard(now)
        kind = requests.KINDS[type(req)]
        rules = self._job_to_join(job_id, req, now, arrival) if isinstance(req, JoinRequest) \
            else self.rules(job_id)
        with self._counting(rules.job):           # a call may add node records, or lose or drain nodes
            node = requests.authenticate(kind, rules, req, now, arrival.hold)
            call = requests.Call(rules, node, now, arrival, self.live_round(job_id), self.unhealthy)
            requests.note_progress(call, req)
            why_not = kind.rule(call, req)
        status = node_status(rules.job, req.node_id, now, accepted=not why_not, reason=why_not)
        if kind.reply is not None:
            kind.reply(call, status)
        return status

    def _job_to_join(self, job_id: str, req: JoinRequest, now: float, arrival: Arrival) -> JobRules:
        """The job a join enters: found, or made (a new id, or a finished one's id reused; its peer-copy key comes
        from its creator's secret, `arrival.secret`); refused past the limits or to a host held as unhealthy."""
        self.unhealthy.check(req.host or req.addr, req.node_id, now, source=arrival.peer)
        secret = arrival.secret
        job = self.jobs.get(job_id)
        if job is not None and job.state.finished:
            # The next agent of a member of a run that succeeded (proven by the secret its predecessor left in the
            # node's memory), as long as the run's record is kept: its workers ran in it, so it ends, and it is no
            # failure (a review: refused as late, exit 1, a service manager's fifth try, past the 10 s below, trained
            # a new run alone from step 0)
            if job.state == JobState.SUCCEEDED and \
                    gone_nodes.took_part(job, req.node_id, req.predecessor, req.instance):
                raise RendezvousError(ErrorCode.RUN_SUCCEEDED, (
                    f"job {job_id!r} has already succeeded ({job.reason}), and this node's workers ran in it: "
                    "nothing is left for it to run"))
            late = job.finished_at is None or now - job.finished_at < REUSE_FINISHED_AFTER_S
            # The next agent of a node killed in that run (it shows the secret its predecessor left in the node's
            # memory: systemd's Restart=) is as late as its predecessor: a new run would train from step 0 again (a
            # review: a member killed near the end of an elastic job came back to a new run of it, alone). Only after
            # a success: a run closed or failed is relaunched at once by operators, a stopped node's agent first (a
            # review: its join refused as late, the new run waited for it and failed).
            if late and (not req.instance or req.predecessor and job.state == JobState.SUCCEEDED or
                         any(n.instance == req.instance for n in job.nodes.values())):
                raise RendezvousError(ErrorCode.JOB_FINISHED,
                                      f"job {job_id!r} has already {job.state.value}: {job.reason}")
            self._check_room(None, now)
            rules = self._create(job_id, req.config, req.node_id, now, secret)
            rules.record(now, EventKind.JOB_REUSED,
                         f"job id reused: the previous run {job.state.value} ({job.reason})")
            return rules
        if job is None:
            self._check_room(None, now)
            return self._create(job_id, req.config, req.node_id, now, secret)
        rules = JobRules(job, self.outbox)
        if req.node_id not in job.nodes:
            admission.check_join(rules, req)   # a refusal for what was asked comes before one for room
            self._check_room(job, now)
        return rules

    @contextmanager
    def _counting(self, job: JobRecord) -> Iterator[None]:
        """Keep `node_count` (all jobs' node records) right across a call that may add or remove some."""
        before = len(job.nodes)
        try:
            yield
        finally:
            self.node_count += len(job.nodes) - before

    def _check_room(self, job: JobRecord | None, now: float) -> None:
        """Refuse a new job or node record past the server's limits (after forgetting what may go)."""
        lim = self.limits
        if job is None and len(self.jobs) >= lim.max_jobs:
            self._prune(now, oldest_first=len(self.jobs) - lim.max_jobs + 1)
            if len(self.jobs) >= lim.max_jobs:
                raise RendezvousError(ErrorCode.LIMIT_REACHED, f"this server holds {len(self.jobs)} jobs, its "
                                      f"limit (--max-jobs {lim.max_jobs}), and none has finished; retry later")
        if job is not None and len(job.nodes) >= node_room(job.config):
            raise RendezvousError(ErrorCode.LIMIT_REACHED, f"job {job.job_id!r} holds {len(job.nodes)} nodes, "
                                  f"its limit (max_nodes {job.config.max_nodes} plus as many spares)")
        if self.node_count >= lim.max_nodes:
            raise RendezvousError(ErrorCode.LIMIT_REACHED, f"this server holds {self.node_count} nodes, its "
                                  f"limit (--max-nodes {lim.max_nodes}); retry later")

    def poll_ended(self, job_id: str, node_id: str, now: float, heard_at: float | None = None) -> None:
        """A held poll was answered: the lease runs again from `heard_at`, its connection's last sign of life."""
        job = self.jobs.get(job_id)
        if job is not None:
            if heard_at is not None:          # a sign of life too, for telling an outage apart
                self.heard(min(heard_at, now))
            JobRules(job, self.outbox).poll_ended(node_id, now, heard_at)

    def live_round(self, job_id: str) -> LiveRound:
        return self.live_rounds.setdefault(job_id, LiveRound())

    def connection_dropped(self, job_id: str, node_id: str, now: float, heard: bool = False) -> None:
        """A node's long-poll connection closed: a short grace; `heard`: its host closed it, not a keepalive."""
        job = self.jobs.get(job_id)
        if job is not None:
            JobRules(job, self.outbox).connection_dropped(node_id, now, heard)

    def view(self, job_id: str, node_id: str, now: float) -> NodeStatus:
        return node_status(self.rules(job_id).job, node_id, now)

    # ---- operator actions (operator_rules.py) ---------------------------------------------

    def close_job(self, job_id: str, reason: str, now: float) -> JobRecord:
        return self.operate(job_id, operator_rules.CloseJob(reason), now)

    def drain_node(self, job_id: str, node_id: str, reason: str, now: float) -> JobRecord:
        return self.operate(job_id, operator_rules.DrainNode(node_id, reason), now)

    def clear_exclusion(self, job_id: str, node_id: str, now: float) -> JobRecord:
        return self.operate(job_id, operator_rules.ClearExclusion(node_id), now)

    def resize(self, job_id: str, min_nodes: int, max_nodes: int, now: float) -> JobRecord:
        return self.operate(job_id, operator_rules.ResizeJob(min_nodes, max_nodes), now)

    def operate(self, job_id: str, action: operator_rules.OperatorAction, now: float) -> JobRecord:
        """An operator action on an open job (refused on a finished one, changing nothing)."""
        rules = self.rules(job_id)
        if rules.job.state.finished:
            raise RendezvousError(ErrorCode.JOB_FINISHED, f"job {job_id!r} has already "
                                  f"{rules.job.state.value}: {rules.job.reason}")
        with self._counting(rules.job):
            operator_rules.apply(rules, action, now)
        return rules.job

    # ---- time ----------------------------------------------------------------------------

    def tick(self, now: float, lag_s: float = 0.0) -> list[str]:
        """Apply every passed deadline; return the ids of the jobs that changed. `lag_s`: how late the loop runs."""
        quiet = now - self.heard_at if self.heard_at is not None else 0.0
        quiet_s = quiet if QUIET_S <= quiet < OUTAGE_LIMIT_S else None
        # A lease that ran out since anyone was heard says nothing about its node yet (leases.py): judged later.
        doubt_s = quiet if DOUBT_QUIET_S <= quiet < QUIET_S else 0.0
        changed = []
        for job in self.jobs.values():
            if job.state.finished:
                continue
            seq = job.event_seq
            with self._counting(job):
                wave = self._waves.setdefault(job.job_id, ReturnWave()) if self.silence is not None else None
                hearing = Hearing(lag_s=lag_s, quiet_s=quiet_s, doubt_s=doubt_s, silence=self.silence,
                                  wave=wave, say_quiet=job.job_id not in self._quiet_noted)
                rules = JobRules(job, self.outbox)
                extended = rules.tick(now, hearing)
                swaps.tick(rules, now)
                reports.judge_held(rules, None, -1, now)
            if extended:
                self._quiet_noted.add(job.job_id)
            if job.event_seq != seq:      # every decision records an event
                changed.append(job.job_id)
        self._prune(now)
        return changed

    def next_deadline(self) -> float | None:
        due = [min(deadlines(job), default=None) for job in self.jobs.values() if not job.state.finished]
        oldest = self._oldest_ended()
        if oldest is not None:
            due.append(self._forget_at(oldest.finished_at or 0.0))
        return min((d for d in due if d is not None), default=None)

    def _forget_at(self, finished_at: float) -> float:
        """When a job ended at `finished_at` is forgotten: rounded up to the second, so close ones go in one tick."""
        return float(math.ceil(finished_at + self.limits.retain_finished_s))

    def _note_ended(self) -> None:
        for job_id in self.outbox.finished:
            job = self.jobs.get(job_id)
            if job is not None and job.finished_at is not None:
                heapq.heappush(self._ended, (job.finished_at, job_id))
        self.outbox.finished.clear()

    def _oldest_ended(self) -> JobRecord | None:
        """The finished job that ended first (stale heap entries are dropped on the way)."""
        self._note_ended()
        while self._ended:
            at, job_id = self._ended[0]
            job = self.jobs.get(job_id)
            if job is not None and job.state.finished and (job.finished_at or 0.0) == at:
                return job
            heapq.heappop(self._ended)
        return None

    def _prune(self, now: float, oldest_first: int = 0) -> None:
        """Forget finished jobs past their retention, and `oldest_first` more of them (oldest first)."""
        cutoff = now - self.limits.retain_finished_s
        while (job := self._oldest_ended()) is not None and ((job.finished_at or 0.0) <= cutoff or oldest_first > 0):
            if (job.finished_at or 0.0) > cutoff:
                oldest_first -= 1
            heapq.heappop(self._ended)
            del self.jobs[job.job_id]
            self.live_rounds.pop(job.job_id, None)
            self._waves.pop(job.job_id, None)
            self.node_count -= len(job.nodes)
            self.outbox.pruned.add(job.job_id)
            self.outbox.changed.pop(job.job_id, None)

    def restored(self, now: float, away_s: float, clean: bool) -> None:
        """The server restarted on a saved state: nobody is blamed for the time it was away."""
        how = "after a clean shutdown" if clean else "without a clean shutdown (killed or crashed)"
        self.heard_at = now              # its silence while it was away is not the agents' fault
        for job in self.jobs.values():
            if not job.state.finished:
                JobRules(job, self.outbox).restored(now, away_s, how)

    def put_back(self, job_id: str, job: JobRecord | None, now: float) -> None:
        """A job as last saved replaces one whose change the store refused (None: never saved); its nodes get fresh
        leases, as after a restart: the refusal was not theirs."""
        old = self.jobs.pop(job_id, None)
        self.node_count -= len(old.nodes) if old is not None else 0
        if job is None:
            return
        self.jobs[job_id] = job
        self.node_count += len(job.nodes)
        for node in job.nodes.values():
            node.dropped, node.holding = False, 0
        extend(job.nodes.values(), now, job.config.lease_timeout_s, self.outbox)

    # ---- lookups -------------------------------------------------------------------------

    def rules(self, job_id: str) -> JobRules:
        job = self.jobs.get(job_id)
        if job is None:
            raise RendezvousError(ErrorCode.UNKNOWN_JOB, unknown_job(job_id))
        return JobRules(job, self.outbox)

    def _create(self, job_id: str, config: JobConfig, creator: str, now: float, secret: str = "") -> JobRules:
        job = JobRecord(job_id=job_id, config=config, state=JobState.WAITING, created_at=now,
                        join_deadline=now + config.join_timeout_s, replica_key=credentials.replica_key(secret))
        self.jobs[job_id] = job
        self.outbox.new_runs.add(job_id)
        self.outbox.deadline(now + config.join_timeout_s)
        rules = JobRules(job, self.outbox)
        rules.record(now, EventKind.JOB_CREATED, f"job created by {creator}: nodes "
                     f"{config.min_nodes}:{config.max_nodes}, max_restarts {config.max_restarts}", creator)
        return rules
