"""Prometheus metrics of the rendezvous server, served as `GET /metrics` (text format); each metric's help text
below says what it counts. Every app owns one `CollectorRegistry` (never the global one), so several servers can
share a process. State is read at scrape time from the core; history is counted from the core's effects
(`Coordinator.effect_listeners`); HTTP traffic is measured by `metrics_middleware`.
"""
from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import prometheus_client
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from protocol.codec import REQUEST_TYPES
from protocol.messages import FailureReason, JobState, NodeState, UnhealthyKind
from protocol.restarts import PHASES
from rdzv_server.coordinator import Coordinator
from rdzv_server.core.events import EventKind, RoundCause
from rdzv_server.core.outbox import Outbox
from rdzv_server.core.payloads import (
    HangDetected,
    NodeUnhealthy,
    RoundFormed,
    WorkerFailed,
    WorkersFailed,
    payload_of,
)
from rdzv_server.core.records import Event, JobRecord
from rdzv_server.core.suspects import Action as SuspectAction
from rdzv_server.web.views import progress

# No `*_created` series: they double the output and no dashboard here reads them (process-wide switch).
prometheus_client.disable_created_metrics()   # type: ignore[no-untyped-call]  # untyped in the library

log = logging.getLogger("rdzv_server")

# 1 ms .. 60 s, roughly 1-2.5-5 per decade.
ROUND_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
# 1 ms .. 30 s: a long-poll answers after at most its wait_s (<= half the lease).
HTTP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0)
FAILURE_REASONS = tuple(r.value for r in FailureReason)
LOSS_CAUSES = (RoundCause.FAILURE.value, RoundCause.HANG.value, RoundCause.NODE_LOST.value)
CAUSES = tuple(c.value for c in RoundCause)
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
NODE_STATES = tuple(s for s in NodeState if s != NodeState.GONE)
UNHEALTHY_KINDS = tuple(k.value for k in UnhealthyKind)
# Per-job series (a `job` label) for at most this many unfinished jobs, the first by id: a server holds up to
# thousands of jobs, and a scrape's size must not grow with them (rdzv_job_series_omitted counts the rest).
MAX_JOB_SERIES = 100


class StateCollector(Collector):
    """What is read at scrape time (no bookkeeping on the request path): jobs, nodes, long-polls and
    unhealthy hosts from the core; the durable store's commits; the event loop's lag."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    def collect(self) -> Iterable[Metric]:
        core, st, lag = self.coordinator.core, self.coordinator.persister.stats, self.coordinator.loop_lag
        jobs = {s: 0 for s in JobState}
        nodes: dict[NodeState, int] = {s: 0 for s in NODE_STATES}
        for job in core.jobs.values():
            jobs[job.state] += 1
            if job.state.finished:
                continue          # its agents are told the job ended: none of its nodes is live
            for node in job.nodes.values():
                if node.state in nodes:
                    nodes[node.state] += 1
        fam_jobs = GaugeMetricFamily("rdzv_jobs", "Jobs held by this server, by state.", labels=["state"])
        for state, n in jobs.items():
            fam_jobs.add_metric([state.value], n)
        fam_nodes = GaugeMetricFamily("rdzv_nodes", "Nodes of unfinished jobs, by state "
                                      "(waiting, member, spare, excluded).", labels=["state"])
        for node_state, n in nodes.items():
            fam_nodes.add_metric([node_state.value], n)
        return [
            fam_jobs, fam_nodes,
            GaugeMetricFamily("rdzv_open_long_polls", "Agent long-polls now waiting for an answer.",
                              self.coordinator.hub.open),
            # A standby holds no jobs: its job gauges read 0 whatever runs. This says which replica to believe.
            GaugeMetricFamily("rdzv_serving", "1: this server serves agents and its job and node gauges count "
                              "them (among replicas, the leader); 0: a standby, or a server loading or stopping, "
                              "whose job and node gauges count nothing.", 1.0 if self.coordinator.serving() else 0.0),
            GaugeMetricFamily("rdzv_requests_waiting_for_leader", "Agent requests held during an election, "
                              "answered once this replica leads or knows the leader (at most 3 s).",
                              self.coordinator.gate.parked),
            GaugeMetricFamily("rdzv_unhealthy_hosts", "Hosts held out of every job as unhealthy now "
                              "(rdzv-server --unhealthy-hold; cleared by rdzv-ctl clear-unhealthy).",
                              len(core.unhealthy.current(self.coordinator.clock()))),
            CounterMetricFamily("rdzv_store_commits", "State store commits (each one fsynced transaction).",
                                st.commits),
            CounterMetricFamily("rdzv_store_commit_failures", "State store commits that failed (kept and retried).",
                                st.failures),
            CounterMetricFamily("rdzv_store_commit_seconds", "Time spent committing, summed over all commits.",
                                st.total_s),
            GaugeMetricFamily("rdzv_store_commit_max_seconds", "Longest state store commit since start.", st.max_s),
            GaugeMetricFamily("rdzv_event_loop_lag_max_seconds",
                              "Longest delay of the event loop since start (a stall).",
                              lag.max_s if lag is not None else 0.0),
            CounterMetricFamily("rdzv_deadline_wakeups", "Times the deadline timer woke: for a deadline due, or "
                                "one brought forward (lease renewals never wake it).",
                                self.coordinator.timer_wakeups)]


class JobCollector(Collector):
    """Each unfinished job's training progress, read at scrape time through the same view the status page shows
    (web/views.py), so both agree. Jobs that never stepped have no progress series: no signal is not 0 steps/s,
    and a ratio of nothing would be NaN."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    def collect(self) -> Iterable[Metric]:
        now = self.coordinator.clock()
        unfinished = [job for job in self.coordinator.core.jobs.values() if not job.state.finished]
        shown = heapq.nsmallest(MAX_JOB_SERIES, unfinished, key=lambda job: job.job_id)
        steps = GaugeMetricFamily("rdzv_job_steps", "Training steps a job took, every round together (jobs whose "
                                  "workers report progress).", labels=["job"])
        pace = GaugeMetricFamily("rdzv_job_steps_per_second", "A job's steps per second lately (the median "
                                 "member's; 0 while a restart is under way).", labels=["job"])
        ratio = GaugeMetricFamily("rdzv_job_effective_training_ratio", "A job's effective training time ratio: "
                                  "the time since its first step less the time restarts cost (the one under way "
                                  "too), over the time since its first step (0..1).", labels=["job"])
        lost = GaugeMetricFamily("rdzv_job_restart_lost_seconds", "Time a job lost to restarts done: from the last "
                                 "step before each to the first step after it.", labels=["job"])
        slow = GaugeMetricFamily("rdzv_slow_nodes", "Members of a job named slow now (the other nodes wait on them).",
                                 labels=["job"])
        awaited = GaugeMetricFamily("rdzv_job_awaited_nodes", "Nodes a job waits for now, their places kept while "
                                    "their agents restart (killed, or stopped by systemctl restart).", labels=["job"])
        phases = GaugeMetricFamily("rdzv_job_restart_phase_seconds", "Where a job's latest measured restart took "
                                   "its time, per phase (stop, rendezvous, start, setup, cuda, group, restore, "
                                   "first_step), on the node the job waited for (protocol/restarts.py).",
                                   labels=["job", "phase"])
        copies = _CopyFamilies()
        for job in shown:
            copies.add(job)
            view = progress(job, now)
            slow.add_metric([job.job_id], len(view.slow_nodes))
            awaited.add_metric([job.job_id], len(job.awaited))
            if not view.signal:
                continue
            steps.add_metric([job.job_id], view.steps)
            pace.add_metric([job.job_id], view.steps_per_s)
            if view.ettr is not None:
                ratio.add_metric([job.job_id], view.ettr)
            lost.add_metric([job.job_id], view.lost_s)
            latest = next((c.anatomy for c in reversed(view.costs) if c.anatomy is not None), None)
            for phase in PHASES if latest is not None else ():
                phases.add_metric([job.job_id, phase], getattr(latest, phase))
        return [steps, pace, ratio, lost, slow, awaited, phases, copies.lag, copies.sent, copies.refused,
                GaugeMetricFamily("rdzv_job_series_omitted", f"Unfinished jobs left out of the per-job series "
                                  f"(at most {MAX_JOB_SERIES} jobs have them, the first by id).",
                                  len(unfinished) - len(shown))]


class _CopyFamilies:
    """Peer copies of a job's snapshots (issue 46), as its members' agents last said on their polls: how far the
    newest copy lags the newest snapshot (steps, the worst member), bytes sent and pushes refused (all members)."""

    def __init__(self) -> None:
        self.lag = GaugeMetricFamily("rdzv_job_copy_lag_steps", "Steps between a member's newest in-memory snapshot "
                                     "and its newest copy on a peer, the worst member's.", labels=["job"])
        self.sent = GaugeMetricFamily("rdzv_job_copy_sent_bytes", "Bytes of snapshot copies the members' agents "
                                      "have sent to peers (as each agent counts, since it started).", labels=["job"])
        self.refused = GaugeMetricFamily("rdzv_job_copy_refusals", "Copies a peer refused or could not take "
                                         "(a full memory limit, a peer away), as the agents count.", labels=["job"])

    def add(self, job: JobRecord) -> None:
        notes = [n.copies for n in job.nodes.values()
                 if n.copies is not None and n.copies.copying and n.state == NodeState.MEMBER]
        if not notes:
            return
        self.lag.add_metric([job.job_id], max(max(0, c.local_step - max(c.copied_step, 0)) for c in notes))
        self.sent.add_metric([job.job_id], sum(c.sent_bytes for c in notes))
        self.refused.add_metric([job.job_id], sum(c.refused for c in notes))


class ConnectionCollector(Collector):
    """The connection guard's refusals and evictions (rdzv-server only: an app alone has no guard)."""

    def __init__(self, counts: Callable[[], tuple[int, int, int, int]]) -> None:
        self.counts = counts

    def collect(self) -> Iterable[Metric]:
        refused, evicted, gave_way, heads = self.counts()
        return [CounterMetricFamily("rdzv_connections_refused",
                                    "Connections closed at once past the hard connection limit.", refused),
                CounterMetricFamily("rdzv_connections_evicted",
                                    "Idle connections closed to make room for new ones (--max-connections).", evicted),
                CounterMetricFamily("rdzv_polls_gave_way",
                                    "Held long-polls answered early, their connections closed, to let a new connection "
                                    "in at the hard connection limit (none idle).", gave_way),
                CounterMetricFamily("rdzv_connections_unfinished_heads",
                                    "Connections closed for a request head not whole in time, or for the oldest "
                                    "heads in flight when together they held too many bytes.", heads)]


class ServerMetrics:
    """One app's registry and metrics. `on_effects` is the coordinator's effect listener."""

    def __init__(self, coordinator: Coordinator) -> None:
        # auto_describe: the registry learns the collectors' names from one collect (no describe to keep in step)
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        r.register(StateCollector(coordinator))
        r.register(JobCollector(coordinator))
        self.rounds = Counter("rdzv_rounds_total", "Rounds formed, by cause (what triggered the round).",
                              ["cause"], registry=r)
        self.restarts = Counter(
            "rdzv_restarts_total", "Restarts after a worker failure: one per accepted failure report "
            "(job-wide restart count + 1). The report that exhausts max_restarts fails the job instead "
            "and is not counted (see rdzv_jobs{state=\"failed\"}).", registry=r)
        self.worker_failures = Counter("rdzv_worker_failures_total", "Failed workers, by reason (the agents' "
                                       "exited, exited early, spawn failed, store exited, fenced; the server's hang; "
                                       "other).", ["reason"], registry=r)
        self.suspects = Counter("rdzv_suspects_total", "Nodes made suspects by a worker's exit code that asks for "
                                "other hardware (suspect_exit_codes), by what was done: replaced (a ready spare took "
                                "its place), excluded (a suspect twice within the window), kept (no ready spare).",
                                ["action"], registry=r)
        self.hangs = Counter("rdzv_hangs_total", "Hangs detected: a round's ranks waited on one that stalled, and "
                             "the round was failed with that rank as its cause.", registry=r)
        self.nodes_lost = Counter("rdzv_nodes_lost_total", "Nodes lost: lease expired, long-poll connection "
                                  "dropped, or agent restarted (nodes that leave are not counted).", registry=r)
        self.nodes_unhealthy = Counter("rdzv_nodes_unhealthy_total", "Nodes that left a job unhealthy, by "
                                       "kind (gpu, health_check, gpu_fault, stuck_worker).", ["reason"], registry=r)
        self.formation = Histogram("rdzv_round_formation_seconds", "Time from a round starting to form "
                                   "(first node waiting, or the failure/loss) to the round being formed.",
                                   buckets=ROUND_BUCKETS, registry=r)
        self.recovery = Histogram("rdzv_failure_to_round_seconds", "Time from a worker failure (or a lost "
                                  "node's last contact) to the next round being formed, by cause.",
                                  ["cause"], buckets=ROUND_BUCKETS, registry=r)
        self.requests = Counter("rdzv_http_requests_total", "HTTP requests answered, by route template, "
                                "method and status.", ["route", "method", "status"], registry=r)
        self._children: dict[tuple[str, str, str], tuple[Any, Any]] = {}
        self.latency = Histogram("rdzv_http_request_duration_seconds", "HTTP request latency (long-polls "
                                 "included), by route template, method and status.",
                                 ["route", "method", "status"], buckets=HTTP_BUCKETS, registry=r)
        # each labelled series is exported (as 0) before its first count
        for metric, values in ((self.rounds, CAUSES), (self.worker_failures, (*FAILURE_REASONS, "other")),
                               (self.nodes_unhealthy, UNHEALTHY_KINDS), (self.recovery, LOSS_CAUSES),
                               (self.suspects, tuple(a.value for a in SuspectAction))):
            for value in values:
                metric.labels(value)

    def on_effects(self, effects: Outbox) -> None:
        """Coordinator effect listener. A metrics bug must never fail a request: log it and go on."""
        try:
            for _job, event in effects.events:
                self._count(event)
            if effects.restarts:
                self.restarts.inc(len(effects.restarts))
            for action in effects.suspects:
                self.suspects.labels(action).inc()
        except Exception:
            log.exception("metrics: could not count the core's effects")

    def _count(self, event: Event) -> None:
        match payload_of(event.kind, event.data):
            case RoundFormed(cause=cause, formation_s=formation_s, since_failure_s=since_failure_s):
                self.rounds.labels(cause if cause in CAUSES else "other").inc()
                if formation_s is not None:
                    self.formation.observe(formation_s)
                if since_failure_s is not None:
                    self.recovery.labels(cause if cause in LOSS_CAUSES else "other").observe(since_failure_s)
            case WorkerFailed(reason=reason):
                self.worker_failures.labels(reason if reason in FAILURE_REASONS else "other").inc()
            case WorkersFailed(reason=reason, count=count):
                self.worker_failures.labels(reason if reason in FAILURE_REASONS else "other").inc(max(1, count))
            case NodeUnhealthy(kind=kind):
                self.nodes_unhealthy.labels(kind if kind in UNHEALTHY_KINDS else "other").inc()
            case HangDetected():
                self.hangs.inc()
        if event.kind == EventKind.NODE_LOST:
            self.nodes_lost.inc()

    def observe_request(self, request: web.Request, status: str, seconds: float) -> None:
        key = (route_label(request), request.method if request.method in METHODS else "other", status)
        children = self._children.get(key)
        if children is None:        # the label sets are few (route templates): look each up once
            children = self._children[key] = (self.requests.labels(*key), self.latency.labels(*key))
        children[0].inc()
        children[1].observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


METRICS = web.AppKey("metrics", ServerMetrics)


def route_label(request: web.Request) -> str:
    """The matched route's template (bounded cardinality), never the raw path; an agent action filled in (joins
    must not share buckets with long-polls); "unmatched" when no route matched."""
    resource = request.match_info.route.resource
    if resource is None:
        return "unmatched"
    template = resource.canonical
    action = request.match_info.get("action")
    if "{action}" in template and action in REQUEST_TYPES:
        template = template.replace("{action}", action)
    return template


@web.middleware
async def metrics_middleware(request: web.Request,
                             handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Count and time every request; outermost, so it sees the status the client gets."""
    metrics = request.app[METRICS]
    start = time.perf_counter()
    status = "500"
    try:
        response = await handler(request)
        status = str(response.status)
        return response
    except web.HTTPException as exc:
        status = str(exc.status)
        raise
    except asyncio.CancelledError:
        status = "499"          # the client went away before the answer (nginx's convention)
        raise
    finally:
        metrics.observe_request(request, status, time.perf_counter() - start)


async def metrics_endpoint(request: web.Request) -> web.Response:
    """GET /metrics: Prometheus text format."""
    return web.Response(body=request.app[METRICS].exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})
