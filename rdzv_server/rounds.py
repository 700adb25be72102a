"""Turning an ordered list of member nodes into one round's assignments.

Group rank is the position in the list. A node's global rank offset is the sum of the local world
sizes before it, so nodes may run different numbers of workers. MASTER_ADDR/PORT are the ones the
group-rank-0 node published: its worker rank 0 hosts the store.
"""
from __future__ import annotations

from protocol.messages import Assignment
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
