"""What a commit writes for one job, in every store's shape: the job's own row (no nodes, no history), the rows of
the nodes the core said changed (None: delete), and the new events. Leases and node `state` are not saved (re-armed
or derived on load). Encoding runs on the event loop (msgspec); stores only move the bytes.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from rdzv_server.core import places
from rdzv_server.core.records import MAX_EVENTS_PER_JOB, Event, JobRecord, NodeRecord


@dataclass
class JobSnapshot:
    job_id: str
    record: bytes                                         # JobRecord without nodes and events
    nodes: dict[str, bytes | None] = field(default_factory=dict)   # node id -> record, None: delete it
    events: list[tuple[int, bytes]] = field(default_factory=list)  # new events: (seq, encoded)
    reset: bool = False                                   # a new run reused the id: drop old nodes and events
    keep_after_seq: int = 0                               # older events may be deleted


_encoder = msgspec.msgpack.Encoder()
job_decoder = msgspec.msgpack.Decoder(JobRecord)
node_decoder = msgspec.msgpack.Decoder(NodeRecord)
event_decoder = msgspec.msgpack.Decoder(Event)


def snapshot(job: JobRecord, node_ids: Iterable[str], new_events: list[Event], reset: bool) -> JobSnapshot:
    """Encode a job as it is now: its own record, the named nodes' records, the events not yet saved."""
    record = _encoder.encode(msgspec.structs.replace(job, nodes={}, events=[]))
    nodes = {nid: (_encoder.encode(job.nodes[nid]) if nid in job.nodes else None) for nid in node_ids}
    events = [(e.seq, _encoder.encode(e)) for e in new_events]
    return JobSnapshot(job.job_id, record, nodes, events, reset, job.event_seq - MAX_EVENTS_PER_JOB)


def assemble(job: JobRecord, nodes: Iterable[NodeRecord], events: list[Event]) -> JobRecord:
    """A loaded job: its rows put together, each node's derived fields set from the job's lists."""
    if not job.nodes:                     # a schema-1 job row keeps its nodes inside
        job.nodes = {n.node_id: n for n in nodes}
    job.events = events
    places.restore(job)
    for node in job.nodes.values():
        node.holding = 0
    return job
