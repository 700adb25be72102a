"""HTTP transport to the rendezvous server. aiohttp's exceptions stop here: callers see the two
kinds from `transport` (`ServerUnreachable`, `ServerRejected`)."""
from __future__ import annotations

import asyncio
from typing import Optional

import aiohttp

from protocol.codec import CONTENT_TYPE, decode_reply, encode
from protocol.errors import ErrorCode
from protocol.messages import (
    PROTOCOL_VERSION,
    ErrorReply,
    FailureReport,
    JobConfig,
    JoinRequest,
    LeaveRequest,
    NodeStatus,
    PollRequest,
    SuccessReport,
    WorkerFailure,
)
from node_agent.transport import ServerRejected, ServerUnreachable

REQUEST_TIMEOUT_S = 10.0


class RdzvClient:
    def __init__(self, host: str, port: int, job_id: str, node_id: str) -> None:
        bracketed = f"[{host}]" if ":" in host else host
        self.base = f"http://{bracketed}:{port}/v1/jobs/{job_id}"
        self.node_id = node_id
        self._session: Optional[aiohttp.ClientSession] = None

    async def __aenter__(self) -> "RdzvClient":
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=8, force_close=False))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    async def _post(self, action: str, message: object, timeout: float = REQUEST_TIMEOUT_S) -> NodeStatus:
        assert self._session is not None, "use `async with RdzvClient(...)`"
        try:
            async with self._session.post(f"{self.base}/{action}", data=encode(message),
                                          headers={"Content-Type": CONTENT_TYPE},
                                          timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                body = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise ServerUnreachable(f"{type(exc).__name__}: {exc}".rstrip(": ")) from None
        try:
            reply = decode_reply(body)
        except Exception:
            raise ServerUnreachable(f"unreadable reply (HTTP {resp.status}) from {self.base}") from None
        if isinstance(reply, ErrorReply):
            if reply.code == ErrorCode.SHUTTING_DOWN.value:
                raise ServerUnreachable(f"server going away: {reply.message}")
            raise ServerRejected(reply.code, reply.message)
        return reply

    async def join(self, *, addr: str, host: str, local_world_size: int, master_port: int, config: JobConfig,
                   instance: str, role: str) -> NodeStatus:
        return await self._post("join", JoinRequest(
            v=PROTOCOL_VERSION, node_id=self.node_id, addr=addr, host=host, local_world_size=local_world_size,
            master_port=master_port, config=config, instance=instance, role=role))

    async def poll(self, known_round: int, wait_s: float, master_port: int = 0) -> NodeStatus:
        return await self._post("poll", PollRequest(v=PROTOCOL_VERSION, node_id=self.node_id,
                                                    known_round=known_round, wait_s=wait_s,
                                                    master_port=master_port),
                                timeout=wait_s + REQUEST_TIMEOUT_S)

    async def report_failure(self, round_id: int, failures: list[WorkerFailure]) -> NodeStatus:
        return await self._post("failure", FailureReport(v=PROTOCOL_VERSION, node_id=self.node_id,
                                                         round_id=round_id, failures=failures))

    async def report_success(self, round_id: int) -> NodeStatus:
        return await self._post("success", SuccessReport(v=PROTOCOL_VERSION, node_id=self.node_id,
                                                         round_id=round_id))

    async def leave(self, reason: str) -> NodeStatus:
        return await self._post("leave", LeaveRequest(v=PROTOCOL_VERSION, node_id=self.node_id, reason=reason),
                                timeout=2.0)
