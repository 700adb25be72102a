"""What the agent needs from a way of talking to the rendezvous server, whatever it is.

Two transports implement it: `client.RdzvClient` (HTTP + MessagePack, the normal case) and
`local_client.LocalClient` (an in-process server for `--standalone`, no HTTP at all).
Both raise only these two exceptions.
"""
from __future__ import annotations

import socket
from protocol.messages import (PROTOCOL_VERSION, FailureReport, JobConfig, JoinRequest, LeaveRequest, NodeStatus,
                               PollRequest, SuccessReport, WorkerFailure)


class ServerUnreachable(Exception):
    """The server could not be reached or is going away: retry later."""


class ServerRejected(Exception):
    """The server answered with a typed error (bad request, config conflict, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class Transport:
    """Builds each request; a subclass only sends it (`_send`) and maps its errors to ours."""

    REQUEST_TIMEOUT_S = 10.0

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id

    async def __aenter__(self) -> Transport:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def _send(self, action: str, message: object, timeout: float) -> NodeStatus:
        raise NotImplementedError

    async def join(self, *, addr: str, host: str, local_world_size: int, master_port: int, config: JobConfig,
                   instance: str, role: str) -> NodeStatus:
        return await self._send("join", JoinRequest(
            v=PROTOCOL_VERSION, node_id=self.node_id, addr=addr, host=host, local_world_size=local_world_size,
            master_port=master_port, config=config, instance=instance, role=role), self.REQUEST_TIMEOUT_S)

    async def poll(self, known_round: int, wait_s: float, master_port: int = 0) -> NodeStatus:
        return await self._send("poll", PollRequest(v=PROTOCOL_VERSION, node_id=self.node_id,
                                                    known_round=known_round, wait_s=wait_s,
                                                    master_port=master_port),
                                wait_s + self.REQUEST_TIMEOUT_S)

    async def report_failure(self, round_id: int, failures: list[WorkerFailure]) -> NodeStatus:
        return await self._send("failure", FailureReport(v=PROTOCOL_VERSION, node_id=self.node_id,
                                                         round_id=round_id, failures=failures),
                                self.REQUEST_TIMEOUT_S)

    async def report_success(self, round_id: int) -> NodeStatus:
        return await self._send("success", SuccessReport(v=PROTOCOL_VERSION, node_id=self.node_id,
                                                         round_id=round_id), self.REQUEST_TIMEOUT_S)

    async def leave(self, reason: str) -> NodeStatus:
        return await self._send("leave", LeaveRequest(v=PROTOCOL_VERSION, node_id=self.node_id, reason=reason),
                                2.0)


def local_addr_towards(host: str, port: int) -> str:
    """The local address this machine uses to reach host:port (no packet is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        infos = socket.getaddrinfo(host, port, family, socket.SOCK_DGRAM)
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(infos[0][4])
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


def free_port(addr: str = "") -> int:
    """A port free right now on this machine (the rank-0 worker binds it for the store)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]
