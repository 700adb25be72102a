"""Operator actions on a job: close it, drain a node, clear an exclusion, change min/max.

A mixin of the rendezvous core (same rules, same purity: `now` in, no I/O). Each action either
raises `RendezvousError` having changed nothing, or records an event saying who asked and why.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from protocol.errors import ErrorCode
from protocol.messages import JobConfig, JobState, NodeState
from rdzv_server.errors import RendezvousError
from rdzv_server.records import Event, JobRecord

if TYPE_CHECKING:
    from rdzv_server.rendezvous import Rendezvous as _Base
else:
    _Base = object


class OperatorRules(_Base):
    def close_job(self, job_id: str, reason: str, now: float) -> JobRecord:
        """End a job now: agents stop their workers and exit (non-zero: the job did not succeed)."""
        job = self._open_job(job_id)
        self._finish(job, now, JobState.CLOSED, f"closed by operator: {reason or 'no reason given'}")
        return job

    def drain_node(self, job_id: str, node_id: str, reason: str, now: float) -> JobRecord:
        """Take a node out of the job; it may not join again until its drain is cleared.

        A member's departure re-forms the round at once without using the restart budget, as a
        node leaving would; its agent sees the node gone, stops its workers and exits.
        """
        job = self._open_job(job_id)
        why = reason or "no reason given"
        job.drained[node_id] = why
        node = job.nodes.get(node_id)
        if node is None:    # lost or not yet joined: it may not (re)join
            job.epoch += 1
            job.record(Event(t=now, seq=0, kind="node_drained", node_id=node_id,
                             message=f"node {node_id} (not in the job now) drained by operator: {why}"))
            return job
        self._remove(job, node, now, "node_drained", f"node {node_id} drained by operator: {why}")
        return job

    def clear_exclusion(self, job_id: str, node_id: str, now: float) -> JobRecord:
        """Readmit an excluded node now (its failure history is forgotten), or lift a drain."""
        job = self._open_job(job_id)
        if node_id in job.drained:
            del job.drained[node_id]
            job.epoch += 1
            job.record(Event(t=now, seq=0, kind="node_undrained", node_id=node_id,
                             message=f"drain of node {node_id} cleared by operator: it may join again"))
            return job
        node = job.nodes.get(node_id)
        if node is None or node_id not in job.excluded:
            raise RendezvousError(ErrorCode.NOT_FOUND,
                                  f"node {node_id!r} is neither excluded nor drained in job {job_id!r}")
        job.excluded.remove(node_id)
        node.excluded_until, node.failure_times, node.exclusions = now, [], 0
        job.record(Event(t=now, seq=0, kind="node_readmitted", node_id=node_id,
                         message=f"exclusion of node {node_id} cleared by operator"))
        job.epoch += 1
        self._admit(job, node, now)
        return job

    def resize(self, job_id: str, min_nodes: int, max_nodes: int, now: float) -> JobRecord:
        """Change a job's min/max nodes. Joins keep matching the config the job started with."""
        job = self._open_job(job_id)
        try:
            # convert, not replace: it checks the fields' bounds as a join's decoding would
            config = msgspec.convert({**msgspec.structs.asdict(job.config), "min_nodes": min_nodes,
                                      "max_nodes": max_nodes}, JobConfig)
        except (msgspec.ValidationError, ValueError) as exc:
            raise RendezvousError(ErrorCode.BAD_REQUEST, f"cannot resize job {job_id!r}: {exc}") from None
        old = job.config
        if job.join_config is None:
            job.join_config = old
        job.config = config
        job.epoch += 1
        job.record(Event(t=now, seq=0, kind="job_resized",
                         message=f"nodes {old.min_nodes}:{old.max_nodes} -> {min_nodes}:{max_nodes} by operator",
                         data={"min_nodes": min_nodes, "max_nodes": max_nodes}))
        members = self._members(job)
        why = f"resized to {min_nodes}:{max_nodes} by operator"
        if job.round is not None:
            extra = job.waiting or job.spares
            if len(members) > max_nodes or len(members) < min_nodes or (extra and len(members) < max_nodes):
                self._form_round(job, now, why, "resized")
            elif job.waiting:      # already at the new max: newcomers become spares, no round to form
                for nid in job.waiting:
                    job.nodes[nid].state = NodeState.SPARE
                job.spares, job.waiting = job.waiting + job.spares, []
                job.last_call_deadline = job.forming_since = None
        elif len(job.waiting) + len(job.spares) >= min_nodes:
            self._form_round(job, now, why, "resized")
        return job

    def _open_job(self, job_id: str) -> JobRecord:
        job = self._job(job_id)
        if job.state.finished:
            raise RendezvousError(ErrorCode.JOB_FINISHED, f"job {job_id!r} has already {job.state.value}: "
                                  f"{job.reason}")
        return job
