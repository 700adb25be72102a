"""Turning an ordered list of member nodes into one round's assignments, and small facts about rounds.

Group rank is the position in the list. A node's global rank offset is the sum of the local world
sizes before it, so nodes may run different numbers of workers. MASTER_ADDR/PORT are the ones the
group-rank-0 node published: its worker rank 0 hosts the store.
"""
from __future__ import annotations

from collections.abc import Iterable

from protocol.messages import Assignment, JobState
from rdzv_server.records import JobRecord, RoundRecord


def build_round(job: JobRecord, members: list[str], round_id: int, opened_at: float, now: float,
                reason: str) -> RoundRecord:
    nodes = [job.nodes[nid] for nid in members]
    world_size = sum(n.local_world_size for n in nodes)
    role_sizes: dict[str, int] = {}
    for n in nodes:
        role_sizes[n.role] = role_sizes.get(n.role, 0) + n.local_world_size
    master = nodes[0]
    assignments: dict[str, Assignment] = {}
    offset = 0
    role_offsets: dict[str, int] = {}
    for group_rank, n in enumerate(nodes):
        role_offset = role_offsets.get(n.role, 0)
        assignments[n.node_id] = Assignment(
            round_id=round_id, group_rank=group_rank, group_world_size=len(nodes), rank_offset=offset,
            world_size=world_size, local_world_size=n.local_world_size, master_addr=master.addr,
            master_port=master.master_port, restart_count=job.restart_count,
            max_restarts=job.config.max_restarts, role_rank_offset=role_offset,
            role_world_size=role_sizes[n.role])
        offset += n.local_world_size
        role_offsets[n.role] = role_offset + n.local_world_size
    return RoundRecord(round_id=round_id, members=list(members), assignments=assignments, opened_at=opened_at,
                       completed_at=now, reason=reason, world_size=world_size,
                       restart_count=job.restart_count)


def candidates(job: JobRecord) -> list[str]:
    members = job.round.members if job.round is not None else []
    return [n for n in members if n in job.nodes] + job.waiting + job.spares


# The category of a round's reason (label `cause` on round events and metrics).
CAUSES = ("start", "scale_up", "failure", "node_lost", "node_left", "node_drained", "resized")


def growth_cause(job: JobRecord) -> str:
    return "scale_up" if job.last_round_id else "start"


def deadlines(job: JobRecord) -> Iterable[float]:
    yield from (n.lease_expires for n in job.nodes.values())
    yield from (job.nodes[n].excluded_until for n in job.excluded)
    if job.last_call_deadline is not None:
        yield job.last_call_deadline
    if job.state == JobState.WAITING and job.last_call_deadline is None and job.join_deadline is not None:
        yield job.join_deadline     # a pending last call forms a round: the join timeout waits for it


def count_nodes(nodes: list[str]) -> str:
    return f"{len(nodes)} node{'s' if len(nodes) != 1 else ''}"
