"""In-process transport for `--standalone`: the agent drives a rendezvous coordinator directly.

No HTTP server and no aiohttp import, so a single-node job starts as fast as Python does. The
coordinator is the same one `rdzv-server` runs, so rounds and restarts behave identically.
"""
from __future__ import annotations

from typing import Awaitable, Callable

from protocol.messages import (PROTOCOL_VERSION, FailureReport, JobConfig, JoinRequest, LeaveRequest, NodeStatus,
                               PollRequest, SuccessReport, WorkerFailure)
from node_agent.transport import ServerRejected, ServerUnreachable
from protocol.errors import ErrorCode
from rdzv_server.coordinator import Coordinator
from rdzv_server.rendezvous import RendezvousError


class LocalClient:
    def __init__(self, job_id: str, node_id: str) -> None:
        self.job_id, self.node_id = job_id, node_id
        self.coordinator = Coordinator()

    async def __aenter__(self) -> "LocalClient":
        await self.coordinator.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.coordinator.stop()

    async def _call(self, action: str, req: object) -> NodeStatus:
        try:
            return await self.coordinator.handle(action, self.job_id, req)
        except RendezvousError as exc:
            if exc.code == ErrorCode.SHUTTING_DOWN:
                raise ServerUnreachable(exc.message) from None
            raise ServerRejected(exc.code.value, exc.message) from None

    async def join(self, *, addr: str, host: str, local_world_size: int, master_port: int, config: JobConfig,
                   instance: str, role: str) -> NodeStatus:
        return await self._call("join", JoinRequest(
            v=PROTOCOL_VERSION, node_id=self.node_id, addr=addr, host=host, local_world_size=local_world_size,
            master_port=master_port, config=config, instance=instance, role=role))

    async def poll(self, known_round: int, wait_s: float, master_port: int = 0) -> NodeStatus:
        return await self._call("poll", PollRequest(v=PROTOCOL_VERSION, node_id=self.node_id,
                                                    known_round=known_round, wait_s=wait_s, master_port=master_port))

    async def report_failure(self, round_id: int, failures: list[WorkerFailure]) -> NodeStatus:
        return await self._call("failure", FailureReport(v=PROTOCOL_VERSION, node_id=self.node_id,
                                                         round_id=round_id, failures=failures))

    async def report_success(self, round_id: int) -> NodeStatus:
        return await self._call("success", SuccessReport(v=PROTOCOL_VERSION, node_id=self.node_id,
                                                         round_id=round_id))

    async def leave(self, reason: str) -> NodeStatus:
        return await self._call("leave", LeaveRequest(v=PROTOCOL_VERSION, node_id=self.node_id, reason=reason))
