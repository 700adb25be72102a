"""What the agent needs from a way of talking to the rendezvous server: `http.RdzvClient` (HTTP +
MessagePack) or `local.LocalClient` (in-process). Both raise only the two exceptions here, and `refusal`
(over `protocol.errors.RETRYABLE`) decides which error codes are worth a retry."""
from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any, Literal, TypeVar

import msgspec

from node_agent.client.path_check import poll_wait
from node_agent.client.replies import ClientCode, Code, Path, code_of
from protocol import keepalive
from protocol.codec import REQUEST_TYPES
from protocol.errors import RETRYABLE, ErrorCode
from protocol.messages import (
    PROTOCOL_VERSION,
    FailureReport,
    JobConfig,
    JoinRequest,
    LeaveRequest,
    NodeStatus,
    PollRequest,
    StallReport,
    SuccessReport,
    UnhealthyKind,
    WorkerFailure,
)
from protocol.notes import CopiesNote, ProgressNote
from protocol.stalls import RankSeen

R = TypeVar("R", JoinRequest, PollRequest, FailureReport, SuccessReport, LeaveRequest, StallReport)

# The action (route) of each request type: the protocol's one table, read backwards.
ACTION_OF: dict[type, str] = {cls: action for action, cls in REQUEST_TYPES.items()}


class ServerUnreachable(Exception):
    """The server could not be reached or is going away: retry later."""


# said of a try whose connection the server took and then closed (it is there: busy, restarting, or making room at
# its connection limit): no hint that it may not be running (retry.unreachable_line)
CLOSED_BY_SERVER = "the server closed the connection"
SERVER_BUSY = "server busy"     # a retryable refusal: the server answered, it serves nobody now


class PathBack(ServerUnreachable):
    """An answer was overdue, but an endpoint answers a fresh connection: send the request again there
    at once (the connection it waited on is stalled in TCP's back-off, or the leader moved)."""


class ServerRejected(Exception):
    """The server answered with a typed error (bad request, config conflict, ...)."""

    def __init__(self, code: Code | str, message: str) -> None:
        super().__init__(f"{code.value if isinstance(code, (ErrorCode, ClientCode)) else code}: {message}")
        self.code: Code = code_of(code)
        self.message = message


def refusal(code: str, message: str) -> ServerUnreachable | ServerRejected:
    """The exception for an error reply: a retryable code ("not now") counts as the server being away."""
    if code in {c.value for c in RETRYABLE}:
        return ServerUnreachable(f"{SERVER_BUSY} ({code}): {message}")
    return ServerRejected(code, message)


class Transport:
    """Builds each request; a subclass only sends it (`_send`) and maps its errors to ours."""

    REQUEST_TIMEOUT_S = 10.0
    LEAVE_TIMEOUT_S = 2.0      # leaving is a courtesy: never hold up an exit for long

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.credential = ""     # the node's secret from its join's reply; every later request carries it
        self.hold_s = 0.0        # the longest the server said it holds this node's polls (0: not said)
        self._joined: asyncio.Event | None = None     # set once the join in flight, if any, has its reply

    async def __aenter__(self) -> Transport:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def _send(self, action: str, message: object, timeout: float) -> NodeStatus:
        raise NotImplementedError

    async def path_back(self) -> bool:
        """Wait until the server can be reached again; whether it was away (without a network: never)."""
        return False

    async def reach(self) -> Path:
        """Whether the server answers a fresh connection now (path_check.py)."""
        return Path.REACHED

    @contextlib.asynccontextmanager
    async def joining(self) -> AsyncIterator[None]:
        """A join under way (each try: join; all of them and the pauses between: ServerLink): a refusal of a request
        sent with the secret it may replace waits for it (_request)."""
        joined = asyncio.Event()
        outer, self._joined = self._joined, joined
        try:
            yield
        finally:
            joined.set()
            if self._joined is joined:
                self._joined = outer

    async def _request(self, message: msgspec.Struct, timeout: float | None = None) -> NodeStatus:
        action, limit = ACTION_OF[type(message)], self.REQUEST_TIMEOUT_S if timeout is None else timeout
        try:
            status = await self._send(action, message, limit)
        except ServerRejected as exc:
            # Sent with a secret a join replaced meanwhile (a rejoin racing a report or poll): about the old
            # record, not a takeover. Once more, with the new one: where the join's reply is not in yet (the
            # refusal came first), once it is.
            sent_with = getattr(message, "credential", "")
            if exc.code != ErrorCode.FORBIDDEN.value or not sent_with:
                raise
            if sent_with == self.credential and not isinstance(message, JoinRequest) and self._joined is not None:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._joined.wait(), limit)
            if sent_with == self.credential:
                raise
            status = await self._send(action, msgspec.structs.replace(message, credential=self.credential), limit)
        if status.credential:            # a join made this node's record afresh: a new secret
            self.credential = status.credential
        return status

    def _for_node(self, cls: type[R], **fields: Any) -> R:
        """A request of type `cls` from this node, carrying its credential."""
        return cls(v=PROTOCOL_VERSION, node_id=self.node_id, credential=self.credential, **fields)

    async def join(self, *, addr: str, host: str, local_world_size: int, master_port: int, config: JobConfig,
                   instance: str, role: str, witness_port: int = 0, command: str = "", checks: str = "",
                   ready: bool = True, domain: str = "", copy_port: int = 0,
                   store_per_round: bool = False, launcher: Literal["", "node-agent", "torchrun"] = "",
                   copy_verifiers: bool = False, predecessor: str = "") -> NodeStatus:
        # torchrun allows an empty role (TorchX passes --role ""); the server's rule wants a name.
        async with self.joining():
            return await self._request(self._for_node(
                JoinRequest, addr=addr, host=host, local_world_size=local_world_size, master_port=master_port,
                config=config, instance=instance, role=role or "default", witness_port=witness_port, command=command,
                checks=checks, ready=ready, domain=domain, copy_port=copy_port, store_per_round=store_per_round,
                launcher=launcher, copy_verifiers=copy_verifiers, predecessor=predecessor))

    async def poll(self, known_round: int, wait_s: float, master_port: int = 0,
                   progress: ProgressNote | None = None, ready: bool = True,
                   copies: CopiesNote | None = None, checks_passed: bool = False,
                   holding: bool = False) -> NodeStatus:
        wait_s = poll_wait(wait_s, self.hold_s)
        return await self._request(self._for_node(PollRequest, known_round=known_round, wait_s=wait_s,
                                                  master_port=master_port, progress=progress, ready=ready,
                                                  copies=copies, checks_passed=checks_passed, holding=holding),
                                   wait_s + self.REQUEST_TIMEOUT_S)

    async def report_failure(self, round_id: int, failures: list[WorkerFailure],
                             progress: ProgressNote | None = None) -> NodeStatus:
        return await self._request(self._for_node(FailureReport, round_id=round_id, failures=failures,
                                                  progress=progress))

    async def report_success(self, round_id: int, progress: ProgressNote | None = None) -> NodeStatus:
        return await self._request(self._for_node(SuccessReport, round_id=round_id, progress=progress))

    async def report_stall(self, round_id: int, threshold_s: float, ranks: list[RankSeen]) -> NodeStatus:
        return await self._request(self._for_node(StallReport, round_id=round_id, threshold_s=threshold_s,
                                                  ranks=ranks))

    async def leave(self, reason: str, unhealthy: UnhealthyKind | None = None, stopped: bool = False,
                    stop_timeout_s: float = 0.0, stop_ended: bool = False) -> NodeStatus:
        return await self._request(self._for_node(LeaveRequest, reason=reason, unhealthy=unhealthy, stopped=stopped,
                                                  stop_timeout_s=stop_timeout_s, stop_ended=stop_ended),
                                   self.LEAVE_TIMEOUT_S)


def local_addr_towards(host: str, port: int) -> str:
    """The local address this machine uses to reach host:port (no packet is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        infos = socket.getaddrinfo(host, port, family, socket.SOCK_DGRAM)
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(infos[0][4])
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()


def keepalive_socket(addr_info: tuple[Any, ...]) -> socket.socket:
    """A client socket with the protocol's keepalive probes (aiohttp's TCPConnector `socket_factory`)."""
    sock = socket.socket(addr_info[0], addr_info[1], addr_info[2])
    keepalive.enable(sock)
    return sock
