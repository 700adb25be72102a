"""Operator views of the rendezvous state: the JSON documents (the HTML page in page.py renders these).
Read-only; times ISO 8601 UTC, durations seconds. Every document is bounded (a page of jobs, of each node
list, at most the kept events); counts are always the whole truth, and `lists_cut` says a list is partial.
Only ordering the jobs grows with their number (one sort of small keys).
"""
from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Mapping
from operator import attrgetter
from typing import Any

import msgspec
from aiohttp import web

from protocol.errors import ErrorCode
from protocol.messages import JobState, NodeState
from protocol.quoting import quote
from protocol.views import (
    DrainedView,
    EventsView,
    EventView,
    JobDetail,
    JobView,
    NodeCounts,
    NodeView,
    ProgressView,
    RestartCostView,
    StatusView,
    to_json,
)
from rdzv_server.core.errors import RendezvousError
from rdzv_server.core.goodput import JobProgress
from rdzv_server.core.progress_rules import shown_stall
from rdzv_server.core.records import MAX_EVENTS_PER_JOB, JobRecord, NodeRecord
from rdzv_server.core.rendezvous import Rendezvous
from rdzv_server.core.rounds import assignment
from rdzv_server.logs import iso

STATUS_LIMIT = 50            # jobs per page of GET /v1/status unless ?limit= says otherwise
STATUS_LIMIT_MAX = 200
LIST_LIMIT = 8               # nodes shown per list (members, waiting, spares, ...) of each job in the status
NODE_LIMIT = 500             # nodes per list of GET /v1/jobs/{id} unless ?node_limit= says otherwise
NODE_LISTS = ("nodes", "waiting", "spares", "excluded", "drained")
HOSTS_LIMIT = 100            # unhealthy hosts listed at most (the oldest holds first)
SLOW_LIMIT = 50              # slow nodes named per job at most
MAX_TIME = 253402300799.0    # 9999-12-31T23:59:59Z: later "times" are bad data, sent as none


def query_int(query: Mapping[str, str], name: str, default: int, *, low: int = 0, high: int | None = None,
              strict: bool = True) -> int:
    """The integer `?name=`, at most `high`; a value that is not a whole number >= `low` is a 400 naming
    the parameter (or, not `strict`, the default: for the HTML page, which never answers an error)."""
    raw = query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if value < low:
        if not strict:
            return default
        raise RendezvousError(ErrorCode.BAD_REQUEST, f"query parameter {name!r} must be a whole number "
                                                     f">= {low}, got {quote(raw)}")
    return value if high is None else min(value, high)


def _node(node: NodeRecord, now: float, restored_at: float = 0.0, **extra: Any) -> NodeView:
    if not node.ready and node.state in (NodeState.WAITING, NodeState.SPARE):
        extra["preparing_for_s"] = round(max(0.0, now - node.preparing_since), 3)
    if node.copies is not None:
        extra["copies"] = node.copies
        if node.noted_at < restored_at:     # saved before the server restarted, no note since: old figures
            extra["copies_before_restart"] = True
    if node.suspect_times:
        extra["suspicions"] = len(node.suspect_times)
    if node.checks_due:
        extra["checks_due"] = True
    return NodeView(node_id=node.node_id, state=node.state.value, host=node.host, addr=node.addr, role=node.role,
                    local_world_size=node.local_world_size, lease_age_s=round(now - node.last_seen, 3),
                    joined_at=iso(node.joined_at), recent_failures=len(node.failure_times), checks=node.checks,
                    **extra)


def _member(job: JobRecord, node: NodeRecord, now: float, succeeded: set[str]) -> NodeView:
    a = assignment(job.round, node.node_id) if job.round is not None else None
    if a is None:
        return _node(node, now, job.restored_at)
    worker = "succeeded" if node.node_id in succeeded else "stopped" if job.state.finished else "running"
    p = job.progress
    # an ended job's paces are history: none is sent
    pace = {} if job.state.finished else dict(slow=node.node_id in p.slow, steps_per_s=_rate(p.rates.get(node.node_id)))
    return _node(node, now, job.restored_at, group_rank=a.group_rank, rank_offset=a.rank_offset, worker_state=worker,
                 **pace)


def _rate(value: float | None) -> float | None:
    """A steps-per-second figure as the views send it: None for none, or one a bad store made no number."""
    return round(value, 4) if value is not None and math.isfinite(value) and value >= 0 else None


def _seconds(value: float) -> float:
    return round(value, 3) if math.isfinite(value) and value > 0 else 0.0


def _time(t: float) -> str | None:
    """A unix time as the views send it; None for none, or for one no clock shows (a bad store)."""
    return iso(t) if math.isfinite(t) and 0 < t < MAX_TIME else None


def progress(job: JobRecord, now: float) -> ProgressView:
    """The job's goodput (core/goodput.py). An unfinished job's ratio counts time up to now (a restart under way
    included); a finished one's stops at its last step, and it has no pace or slow nodes any more, nor has a job
    waiting for nodes a pace. Never raises: a job from an old store has a default progress (no signal)."""
    p = job.progress
    running = not job.state.finished
    stall = shown_stall(job, now) if running else None
    line, kind = (stall.line(now), stall.kind) if stall is not None else (None, None)
    if not p.first_step_at:
        return ProgressView(stall=line, stall_kind=kind)
    pacing = running and job.round is not None       # no round runs (waiting for nodes): the last paces are stale
    ratio = p.ratio(now, running=running)
    pending = p.pending
    slow = [n for n in p.slow if (node := job.nodes.get(n)) is not None and node.state == NodeState.MEMBER]
    return ProgressView(
        signal=True, steps=max(0, p.steps), steps_per_s=(_rate(p.steps_per_s()) or 0.0) if pacing else 0.0,
        ettr=round(ratio, 4) if ratio is not None and math.isfinite(ratio) else None,
        first_step_at=_time(p.first_step_at), last_step_at=_time(p.last_step_at), lost_s=_seconds(p.lost_s),
        restarts=max(0, p.restarts), redone=max(0, p.redone),
        restarting_for_s=_seconds(now - pending.last_step_at) if pending is not None and running else None,
        slow_nodes=slow[:SLOW_LIMIT] if running else [],
        stall=line, stall_kind=kind,
        costs=[RestartCostView(round_id=c.round_id, cause=c.cause, redone=c.redone if c.redone >= 0 else None,
                               cost_s=_seconds(c.cost_s) if c.stepped_at else None, anatomy=c.anatomy,
                               anatomy_node=c.anatomy_node or None) for c in p.costs],
        alike_step=p.alike_step if p.alike_step >= 0 else None)


def rate_points(p: JobProgress) -> list[tuple[str, float]]:
    """The job's steps per second over time, for a picture (at most goodput.MAX_RATE_POINTS)."""
    return [(when, rate) for t, v in p.rate_points if (when := _time(t)) and (rate := _rate(v)) is not None]


def node_lists(job: JobRecord, now: float, offset: int, limit: int) -> dict[str, Any]:
    """Entries offset..offset+limit of each node list, every list's full count, and whether any was cut."""
    r = job.round
    members = r.members if r else []
    succeeded = set(job.successes) if r and job.successes else set()
    # excluded nodes whose agent went (core/gone_nodes.py): still excluded, shown with no agent behind them
    kept_out = [(n, k) for n, k in job.kept_out.items() if k.until > now and n not in job.nodes]
    counts = NodeCounts(nodes=len(members), waiting=len(job.waiting), spares=len(job.spares),
                        excluded=len(job.excluded) + len(kept_out), drained=len(job.drained))
    end = offset + limit

    def page(ids: list[str]) -> list[NodeRecord]:
        return [job.nodes[n] for n in ids[offset:end] if n in job.nodes]

    lists: dict[str, Any] = dict(
        nodes=[_member(job, n, now, succeeded) for n in page(members)],
        waiting=[_node(n, now) for n in page(job.waiting)],
        spares=[_node(n, now, spare_position=i) for i, n in enumerate(page(job.spares), start=offset)],
        excluded=[_node(n, now, excluded_for_s=round(max(0.0, n.excluded_until - now), 1), exclusions=n.exclusions)
                  for n in page(job.excluded)] +
        [NodeView(node_id=n, state=NodeState.GONE.value, host="", addr="", role="", local_world_size=0, lease_age_s=0.0,
                  joined_at=None, recent_failures=0, checks="", excluded_for_s=round(k.until - now, 1),
                  exclusions=k.exclusions)
         for n, k in kept_out[max(0, offset - len(job.excluded)):max(0, end - len(job.excluded))]],
        drained=[DrainedView(n, why) for n, why in itertools.islice(job.drained.items(), offset, end)])
    return dict(lists, counts=counts,
                lists_cut=any(len(lists[name]) < getattr(counts, name) for name in NODE_LISTS))


def _job_head(job: JobRecord, now: float) -> dict[str, Any]:
    r = job.round
    return dict(job_id=job.job_id, state=job.state.value, reason=job.reason, round_id=r.round_id if r else None,
                min_nodes=job.config.min_nodes, max_nodes=job.config.max_nodes, world_size=r.world_size if r else 0,
                group_world_size=len(r.members) if r else 0, restart_count=job.restart_count,
                max_restarts=job.config.max_restarts, created_at=iso(job.created_at), finished_at=iso(job.finished_at),
                progress=progress(job, now), copies_off=job.copies_off if r is not None else "")


def job_summary(job: JobRecord, now: float, list_limit: int = LIST_LIMIT) -> JobView:
    """A job as the status lists it: its head, its counts, and the first `list_limit` nodes of each list."""
    return JobView(**_job_head(job, now), **node_lists(job, now, 0, list_limit))


def job_detail(job: JobRecord, now: float, node_offset: int = 0, node_limit: int = NODE_LIMIT) -> JobDetail:
    return JobDetail(**_job_head(job, now), **node_lists(job, now, node_offset, node_limit),
                     node_offset=node_offset, node_limit=node_limit, config=job.config,
                     last_failure=job.last_failure, root_cause=job.root_cause,
                     last_call_ends_in_s=round(job.last_call_deadline - now, 3) if job.last_call_deadline else None,
                     rate=rate_points(job.progress))


def job_events(job: JobRecord, after: int | None = None, limit: int = MAX_EVENTS_PER_JOB) -> EventsView:
    """Kept events, oldest first: the first `limit` after seq `after` (`more`: others follow), else the newest."""
    if after is None:
        kept, more = (job.events[-limit:] if limit else []), False
    else:
        newer = job.events_after(after)
        kept, more = newer[:limit], len(newer) > limit
    return EventsView(job_id=job.job_id, last_seq=job.event_seq, more=more, events=[
        EventView(seq=e.seq, time=iso(e.t), kind=e.kind.value, message=e.message, node_id=e.node_id or None,
                  round_id=e.round_id if e.round_id >= 0 else None, data=e.data or None) for e in kept])


def ordered_jobs(core: Rendezvous) -> list[JobRecord]:
    """Every job: forming, then running (each by id), then finished ones, newest first (then by id)."""
    jobs = sorted(core.jobs.values(), key=attrgetter("job_id"))
    forming = [j for j in jobs if j.state == JobState.WAITING]
    running = [j for j in jobs if j.state == JobState.RUNNING]
    finished = sorted((j for j in jobs if j.state.finished), key=lambda j: j.finished_at or 0.0, reverse=True)
    return forming + running + finished        # the sorts are stable: ties stay by id


def server_status(core: Rendezvous, now: float, offset: int = 0, limit: int = STATUS_LIMIT,
                  list_limit: int = LIST_LIMIT) -> StatusView:
    """One page of jobs in `ordered_jobs` order; `total` and `job_states` (jobs by state) count every job."""
    page = ordered_jobs(core)[offset:offset + limit]
    total = len(core.jobs)
    return StatusView(time=iso(now), total=total, offset=offset, limit=limit,
                      next_offset=offset + limit if offset + limit < total else None,
                      job_states=dict(Counter(j.state.value for j in core.jobs.values())), list_limit=list_limit,
                      jobs=[job_summary(j, now, list_limit) for j in page],
                      unhealthy_hosts=[h.view(now) for h in core.unhealthy.current(now)[:HOSTS_LIMIT]])


def view_response(view: msgspec.Struct) -> web.Response:
    """A view as its JSON reply."""
    return web.Response(body=to_json(view), content_type="application/json")
