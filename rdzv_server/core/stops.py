"""A stopped agent's stop, over sooner than it said: the wait for its next agent starts then.

An agent stopped by a signal leaves before it stops its workers and tells its --stop-timeout (LeaveRequest.
stop_timeout_s): the wait for it counts from that timeout's end (awaiting.py), so a script saving a checkpoint on
SIGTERM is not gone on without. Most stops take a second or two: the survivors then idled the rest of the timeout
(30 s by default) for nothing. Once its workers stopped and its last copies went, the agent says its stop is over
(LeaveRequest.stop_ended): the wait's start moves to then, never later than it was and never past its bound, and
the job's reason and event say it. Its record is gone by then: the request proves its node with the credential
digest kept with the stop (`StopKept.digest`), once; one without it, or past its stop's told end, changes nothing.
An agent killed in its stop says nothing: its wait stays as told.
"""
from __future__ import annotations

import hmac

from rdzv_server.core import awaiting, credentials
from rdzv_server.core.records import JobRecord, NodeRecord, StopKept


def counted(job: JobRecord, held: list[str], lost: list[NodeRecord], now: float, stopping_s: float) -> None:
    """A wait begins at `now` for `held` (of `lost`), from the end of a stop told to take `stopping_s`: kept, to be
    told over (a record without a credential keeps none: no request could prove it)."""
    job.stops_counted = list(held) if stopping_s else []
    job.stops = {n.node_id: StopKept(digest=n.credential_digest, end=now + stopping_s, since_before=now)
                 for n in lost if stopping_s and n.node_id in held and n.credential_digest}


def ended(job: JobRecord, node_id: str, credential: str, now: float) -> str:
    """`node_id`'s agent says its stop is over (its workers stopped, its last copies sent): its wait counts from
    `now`, unless another awaited member's runs longer. The job's new reason ("": nothing moved: not awaited, back
    already, told once, past its stop's end, or not proven with the node's credential)."""
    stop = job.stops.get(node_id)
    if stop is None or stop.ended or not stop.digest or not credential or \
            not hmac.compare_digest(credentials.digest(credential), stop.digest):
        return ""      # (a refusal tells a forger nothing, and changes nothing)
    deadline = job.last_call_deadline
    if node_id not in job.awaited or not awaiting.wait_runs(job) or deadline is None or stop.end <= now or \
            awaiting.back(job, node_id) or awaiting.preparing(job, node_id) or deadline > awaiting.bound(job):
        return ""      # (past its bound: a newcomer to take a place prepares, awaiting.wait_for_taker)
    stop.ended, stop.end = True, now
    # the wait's start as though every stop counted had been told to take as long as it did (or still may)
    since = max(max(s.since_before, s.end - s.lead) for m, s in job.stops.items() if m in job.awaited)
    job.awaited_since = min(job.awaited_since, since)
    window = awaiting.window_s(job.config)
    ends = [now + window]
    for m in job.awaited:
        if m == node_id or awaiting.back(job, m):
            continue
        if awaiting.preparing(job, m):       # (its time to prepare is kept)
            ends.append(deadline)
        elif (s := job.stops.get(m)) is not None:
            ends.append(s.end + window)
        else:                                # a restart's window: from its loss
            ends.append(job.loss_times[m][-1] + window if job.loss_times.get(m) else deadline)
    job.last_call_deadline = min(deadline, awaiting.capped(job, max(ends)))
    job.reason = f"node {node_id}'s agent ended: {awaiting.waiting(job, now)}"
    return job.reason

