"""A node's place in its job: member, waiting, spare or excluded. Every change of place is made here, so a node's
NodeState, the job's lists (`waiting`, `spares`, `excluded`: their order is the order nodes are taken in) and the
count of waiting nodes still preparing (`waiting_preparing`: a round waits for no such node, counted as they come
and go, so no formation scans a long list) never disagree. Members are the round's own list (Round.members).
No I/O; the callers record the events and wake the nodes."""
from __future__ import annotations

from collections.abc import Iterable

from protocol.messages import NodeState
from rdzv_server.core.records import JobRecord, NodeRecord


def _queue(job: JobRecord, state: NodeState) -> list[str] | None:
    return {NodeState.WAITING: job.waiting, NodeState.SPARE: job.spares,
            NodeState.EXCLUDED: job.excluded}.get(state)


def move(job: JobRecord, node: NodeRecord, state: NodeState) -> None:
    """`node` to the end of `state`'s list (out of any other); MEMBER: in no list (the round names it)."""
    leave(job, node)
    node.state = state
    queue = _queue(job, state)
    if queue is not None:
        queue.append(node.node_id)
        job.waiting_preparing += state == NodeState.WAITING and not node.ready


def leave(job: JobRecord, node: NodeRecord) -> None:
    """`node` out of the list its place puts it in (it is removed from the job, or about to move). Only that list
    is looked at: a new node (GONE until placed) is in none, so a join costs no scan of a long list."""
    queue = _queue(job, node.state)
    if queue is not None and node.node_id in queue:
        queue.remove(node.node_id)
        job.waiting_preparing -= node.state == NodeState.WAITING and not node.ready


def seat(job: JobRecord, members: Iterable[str], waiting: list[str], spares: list[str]) -> None:
    """A round formed (`members`) or the job waits again (no members): every node named goes to its place, the
    lists in these orders. Nodes named nowhere keep theirs (the excluded)."""
    job.waiting, job.spares = list(waiting), list(spares)
    for states, names in ((NodeState.MEMBER, members), (NodeState.WAITING, job.waiting),
                          (NodeState.SPARE, job.spares)):
        for nid in names:
            job.nodes[nid].state = states
    job.waiting_preparing = sum(not job.nodes[nid].ready for nid in job.waiting)


def set_ready(job: JobRecord, node: NodeRecord, ready: bool) -> None:
    """What the node's agent says of its workers (a waiting node's readiness is counted)."""
    if node.ready != ready and node.state == NodeState.WAITING:
        job.waiting_preparing += -1 if ready else 1
    node.ready = ready


def restore(job: JobRecord) -> None:
    """A job loaded from the store: each node's place from the lists and the round, which are what is saved."""
    members = set(job.round.members) if job.round is not None else set()
    place = {**{n: NodeState.WAITING for n in job.waiting}, **{n: NodeState.SPARE for n in job.spares},
             **{n: NodeState.EXCLUDED for n in job.excluded}, **{n: NodeState.MEMBER for n in members}}
    for node in job.nodes.values():
        node.state = place.get(node.node_id, NodeState.WAITING)
    job.waiting_preparing = sum(not job.nodes[nid].ready for nid in job.waiting if nid in job.nodes)
