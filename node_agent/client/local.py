"""In-process transport for `--standalone`: the agent drives `rdzv-server`'s own coordinator (same rounds
and restarts), with no HTTP and no aiohttp import so a single-node job starts as fast as Python does."""
from __future__ import annotations

import hashlib

import msgspec

from node_agent.client.transport import Transport, refusal
from protocol.messages import AgentRequest, JoinRequest, NodeStatus
from rdzv_server.coordinator import Coordinator
from rdzv_server.core.rendezvous import Limits, Rendezvous, RendezvousError


class LocalClient(Transport):
    def __init__(self, job_id: str, node_id: str) -> None:
        super().__init__(node_id)
        self.job_id = job_id
        self.command = ""          # its join's command fingerprint (JoinRequest.command)
        # One node, one job: no other job to keep an unhealthy host out of, so no hold (it checks before rejoining).
        self.coordinator = Coordinator(Rendezvous(limits=Limits(unhealthy_hold_s=0.0)))

    async def __aenter__(self) -> LocalClient:
        await self.coordinator.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.coordinator.stop()

    async def _send(self, action: str, message: object, timeout: float) -> NodeStatus:
        if isinstance(message, JoinRequest):
            self.command = message.command
        try:
            assert isinstance(message, AgentRequest)
            status = await self.coordinator.handle(self.job_id, message)
        except RendezvousError as exc:
            raise refusal(exc.code.value, exc.message) from exc
        if status.assignment is None:
            return status
        return msgspec.structs.replace(status, assignment=msgspec.structs.replace(status.assignment, run=self.run))

    @property
    def run(self) -> str:
        """The job's run (Assignment.run) is its id's and its command's: the coordinator is made anew with each
        agent, so an agent started again with the same command under the same --rdzv-id (systemd's Restart=, a
        container restarted) takes up the memory its predecessor left; another command (a sweep reusing ids) does
        not. A job that ended removed it; without --rdzv-id each start has a fresh id."""
        return "standalone-" + hashlib.sha256(f"{self.job_id}\0{self.command}".encode()).hexdigest()[:16]
