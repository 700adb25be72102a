"""In-process transport for torchrun's static launches (`--node-rank R --master-addr A --master-port P`).
As with torchrun's static rendezvous there is no server: each node knows its place from the values given.
The agent drives the `--standalone` coordinator for a job of this node alone (same restart and end rules)
and maps each assignment onto the static world: group rank R of N, global ranks R * nproc .. (R + 1) *
nproc - 1 (the same --nproc-per-node everywhere, as torchrun assumes), and MASTER_ADDR:MASTER_PORT = A:P
(worker rank 0 hosts the store there).
Restarts are this node's own: nothing tells other nodes of a failure, as under torchrun's static backend."""
from __future__ import annotations

import msgspec

from node_agent.client.local import LocalClient
from protocol.messages import JoinRequest, NodeStatus


class StaticClient(LocalClient):
    def __init__(self, job_id: str, node_id: str, *, node_rank: int, nnodes: int, master_addr: str,
                 master_port: int) -> None:
        super().__init__(job_id, node_id)
        self.node_rank = node_rank
        self.nnodes = nnodes
        self.master_addr = master_addr
        self.master_port = master_port

    async def _send(self, action: str, message: object, timeout: float) -> NodeStatus:
        if isinstance(message, JoinRequest):   # the coordinator's job is this node alone
            message = msgspec.structs.replace(
                message, config=msgspec.structs.replace(message.config, min_nodes=1, max_nodes=1))
        status = await super()._send(action, message, timeout)
        a = status.assignment
        if a is not None:
            offset = self.node_rank * a.local_world_size
            world = self.nnodes * a.local_world_size
            status.assignment = msgspec.structs.replace(
                a, group_rank=self.node_rank, group_world_size=self.nnodes, rank_offset=offset, world_size=world,
                role_rank_offset=offset, role_world_size=world, master_addr=self.master_addr,
                master_port=self.master_port)
        return status
