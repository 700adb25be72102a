"""The kernel's view of a TCP socket (Linux's `TCP_INFO`), as named fields, in one read: what the
server's loop cannot see (when a peer last answered, when a request came in and the last reply went
out, how many connections wait in a listener's accept queue). Off Linux, on a closed socket (uvloop's
stand-in then raises ValueError), or when `check()` finds the struct laid out otherwise, every read
answers None and the rules that use it fall back to what the server sees itself.
"""
from __future__ import annotations

import asyncio
import fcntl
import socket
import struct
import termios
from dataclasses import dataclass
from typing import Any

# struct tcp_info (linux/tcp.h): byte offsets of the u32 fields read (ms for the ages)
# tcpi_state @0, tcpi_unacked @24, last_data_sent @44, last_data_recv @52, last_ack_recv @56
_FIELDS = struct.Struct("=B23xI16xI4xII")
CLOSE_WAIT = 8         # tcpi_state: the peer's FIN is in, the server has not closed its side
_SIZE = 104
_enabled = hasattr(socket, "TCP_INFO")


@dataclass(frozen=True, slots=True)
class TcpInfo:
    unacked: int                  # a listening socket: connections waiting to be accepted
    last_data_sent_s: float
    last_data_recv_s: float
    last_ack_recv_s: float
    state: int = 0

    @property
    def closed_by_peer(self) -> bool:
        """The peer's host sent its FIN (its process ended, or it closed the connection) and the loop has not yet
        read it."""
        return self.state == CLOSE_WAIT


def read(sock: Any) -> TcpInfo | None:
    """`sock`'s TCP_INFO (one system call); None where unknown (see the top)."""
    if sock is None or not _enabled:
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _SIZE)
        state, unacked, sent, received, acked = _FIELDS.unpack_from(raw)
    except (OSError, ValueError, AttributeError, struct.error):
        return None
    return TcpInfo(unacked, sent / 1000.0, received / 1000.0, acked / 1000.0, state)


def of(transport: asyncio.BaseTransport | None) -> TcpInfo | None:
    """The TCP_INFO of a transport's socket."""
    return read(transport.get_extra_info("socket") if transport is not None else None)


def unread_bytes(transport: asyncio.BaseTransport | None) -> int:
    """Bytes in the transport's socket that the loop has not read yet (FIONREAD); 0 where unknown."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    try:
        raw = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")   # type: ignore[union-attr]
        return int(struct.unpack("i", raw)[0])
    except (OSError, ValueError, AttributeError, struct.error):
        return 0


def check() -> str | None:
    """Read a loopback connection once and check the fields mean what they are read as; None when they
    do, else why not (and every read answers None from then on). Run once at the server's start."""
    global _enabled
    if not _enabled:
        return "no TCP_INFO on this platform"
    with socket.socket() as listener, socket.socket() as client:
        try:
            listener.bind(("127.0.0.1", 0))
            listener.listen(4)
            client.connect(listener.getsockname())       # accepted by the kernel, not yet by us: unacked 1
            waiting = read(listener)
            client.sendall(b"x")
            sent = read(client)
            problem = ""
            if waiting is None or sent is None:
                problem = "TCP_INFO cannot be read"
            elif waiting.unacked != 1:
                problem = f"an accept queue of 1 reads as {waiting.unacked}"
            elif not (0.0 <= sent.last_data_sent_s < 5.0 and 0.0 <= sent.last_ack_recv_s < 5.0):
                problem = f"ages just after a send read as {sent.last_data_sent_s} s and {sent.last_ack_recv_s} s"
        except OSError as exc:
            problem = f"the loopback check failed: {exc}"
    if problem:
        _enabled = False
        return f"the kernel's TCP_INFO is not laid out as expected ({problem}); not used"
    return None
