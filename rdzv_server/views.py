"""Operator views of the rendezvous state: the JSON documents (the HTML page in page.py renders these).

Read-only: nothing here changes a job. Times are ISO 8601 UTC; durations are seconds.
"""
from __future__ import annotations

import datetime as dt
from typing import Any

import msgspec

from rdzv_server.records import JobRecord, NodeRecord
from rdzv_server.rendezvous import Rendezvous


def iso(t: float | None) -> str | None:
    if t is None:
        return None
    return dt.datetime.fromtimestamp(t, tz=dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _node(job: JobRecord, node: NodeRecord, now: float) -> dict[str, Any]:
    out: dict[str, Any] = {
        "node_id": node.node_id, "state": node.state.value, "host": node.host, "addr": node.addr,
        "role": node.role, "local_world_size": node.local_world_size,
        "lease_age_s": round(now - node.last_seen, 3), "joined_at": iso(node.joined_at),
        "recent_failures": len(node.failure_times),
    }
    if job.round is not None and node.node_id in job.round.assignments:
        a = job.round.assignments[node.node_id]
        out.update(group_rank=a.group_rank, rank_offset=a.rank_offset,
                   worker_state=_worker_state(job, node.node_id))
    if node.node_id in job.spares:
        out["spare_position"] = job.spares.index(node.node_id)
    if node.node_id in job.excluded:
        out["excluded_for_s"] = round(max(0.0, node.excluded_until - now), 1)
        out["exclusions"] = node.exclusions
    return out


def _worker_state(job: JobRecord, node_id: str) -> str:
    """What the server knows of a member's workers: running, succeeded, or stopped (job ended)."""
    if node_id in job.successes:
        return "succeeded"
    return "stopped" if job.state.finished else "running"


def job_summary(job: JobRecord, now: float) -> dict[str, Any]:
    r = job.round
    members = [job.nodes[n] for n in (r.members if r else []) if n in job.nodes]
    return {
        "job_id": job.job_id, "state": job.state.value, "reason": job.reason,
        "round_id": r.round_id if r else None, "min_nodes": job.config.min_nodes,
        "max_nodes": job.config.max_nodes, "world_size": r.world_size if r else 0,
        "group_world_size": len(r.members) if r else 0,
        "restart_count": job.restart_count, "max_restarts": job.config.max_restarts,
        "created_at": iso(job.created_at), "finished_at": iso(job.finished_at),
        "nodes": [_node(job, n, now) for n in members],
        "waiting": [_node(job, job.nodes[n], now) for n in job.waiting],
        "spares": [_node(job, job.nodes[n], now) for n in job.spares],
        "excluded": [_node(job, job.nodes[n], now) for n in job.excluded],
        "drained": [{"node_id": n, "reason": why} for n, why in job.drained.items()],
    }


def job_detail(job: JobRecord, now: float) -> dict[str, Any]:
    out = job_summary(job, now)
    out["config"] = msgspec.to_builtins(job.config)
    out["last_failure"] = msgspec.to_builtins(job.last_failure) if job.last_failure else None
    out["root_cause"] = msgspec.to_builtins(job.root_cause) if job.root_cause else None
    out["last_call_ends_in_s"] = round(job.last_call_deadline - now, 3) if job.last_call_deadline else None
    return out


def job_events(job: JobRecord) -> dict[str, Any]:
    return {"job_id": job.job_id, "events": [
        {"seq": e.seq, "time": iso(e.t), "kind": e.kind.value, "message": e.message, "node_id": e.node_id or None,
         "round_id": e.round_id if e.round_id >= 0 else None, **({"data": e.data} if e.data else {})}
        for e in job.events]}


def server_status(core: Rendezvous, now: float) -> dict[str, Any]:
    return {"time": iso(now), "jobs": [job_summary(j, now) for j in core.jobs.values()]}
