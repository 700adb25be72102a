"""What the agent needs from a way of talking to the rendezvous server, whatever it is.

Two transports implement it: `client.RdzvClient` (HTTP + MessagePack, the normal case) and
`local_client.LocalClient` (an in-process server for `--standalone`, no HTTP at all).
Both raise only these two exceptions.
"""
from __future__ import annotations

import socket
from typing import Protocol

from protocol.messages import JobConfig, NodeStatus, WorkerFailure


class ServerUnreachable(Exception):
    """The server could not be reached or is going away: retry later."""


class ServerRejected(Exception):
    """The server answered with a typed error (bad request, config conflict, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class Transport(Protocol):
    async def __aenter__(self) -> "Transport": ...
    async def __aexit__(self, *exc: object) -> None: ...
    async def join(self, *, addr: str, host: str, local_world_size: int, master_port: int, config: JobConfig,
                   instance: str, role: str) -> NodeStatus: ...
    async def poll(self, known_round: int, wait_s: float, master_port: int = 0) -> NodeStatus: ...
    async def report_failure(self, round_id: int, failures: list[WorkerFailure]) -> NodeStatus: ...
    async def report_success(self, round_id: int) -> NodeStatus: ...
    async def leave(self, reason: str) -> NodeStatus: ...


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
