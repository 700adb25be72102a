"""A lean HTTP/1.1 transport for simulated nodes, with the kernel's receive time of every reply.

Why not aiohttp's client, as the agent uses: on the 2-core machine the simulated fleet shares the
cores with the server, and aiohttp spends ~300 us of client CPU per request. After a round change
thousands of replies arrive at once; a client process then needs seconds to work through them, and
a wake-up would be timed by when the client got round to it rather than when it arrived. This
transport costs a fraction of that, and reads each reply with `recvmsg` and SO_TIMESTAMPNS, so a
reply's time is when the kernel received it, however late the process reads it.

It is the agent's `Transport` (request building, the node's credential on every request after its
join), sending the same bytes an HTTP client would: one keep-alive connection per node, from the
node's own source address, with the agent's TCP keepalive, a new one after any error. Errors map as
in node_agent/client/http.py.
"""
from __future__ import annotations

import asyncio
import socket
import struct
import time

from node_agent.client.deadline import deadline
from node_agent.client.transport import ServerUnreachable, Transport, keepalive_socket, refusal
from protocol.codec import CONTENT_TYPE, decode_reply, encode
from protocol.messages import ErrorReply, NodeStatus

# Linux's values (asm-generic); the socket module does not name them.
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
SCM_TIMESTAMPNS = SO_TIMESTAMPNS
_CMSG_SPACE = socket.CMSG_SPACE(16)
_TIMESPEC = struct.Struct("@qq")


class WireClient(Transport):
    def __init__(self, port: int, job_id: str, node_id: str, source: str) -> None:
        super().__init__(node_id)
        self.port = port
        self.source = source
        self.path = f"/v1/jobs/{job_id}/"
        self.head = f"Host: 127.0.0.1:{port}\r\nContent-Type: {CONTENT_TYPE}\r\nContent-Length: "
        self.sock: socket.socket | None = None
        self.arrived = 0.0          # time.monotonic() at which the kernel received the last reply

    async def _connect(self) -> socket.socket:
        sock = keepalive_socket((socket.AF_INET, socket.SOCK_STREAM, 0))   # the agent's keepalive probes
        sock.setblocking(False)
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        sock.bind((self.source, 0))
        try:
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", self.port))
        except BaseException:
            sock.close()
            raise
        return sock

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    async def _send(self, action: str, message: object, timeout: float) -> NodeStatus:
        body = encode(message)
        request = f"POST {self.path}{action} HTTP/1.1\r\n{self.head}{len(body)}\r\n\r\n".encode() + body
        try:
            async with deadline(timeout):
                if self.sock is None:
                    self.sock = await self._connect()
                loop = asyncio.get_running_loop()
                await loop.sock_sendall(self.sock, request)
                status, reply = await self._read_reply(loop, self.sock)
        except (OSError, asyncio.TimeoutError, ValueError) as exc:
            self.close()
            raise ServerUnreachable(f"{type(exc).__name__}: {exc}".rstrip(": ")) from exc
        except BaseException:
            self.close()          # cancelled mid-request: the connection's state is unknown
            raise
        try:
            decoded = decode_reply(reply)
        except Exception as exc:
            raise ServerUnreachable(f"unreadable reply (HTTP {status})") from exc
        if isinstance(decoded, ErrorReply):
            raise refusal(decoded.code, decoded.message)
        return decoded

    async def _read_reply(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> tuple[int, bytes]:
        buf = bytearray()
        need = -1                      # bytes of the whole reply, once its head is in
        status = start = 0
        while need < 0 or len(buf) < need:
            data = await self._recv(loop, sock)
            if not data:
                raise ConnectionResetError("the server closed the connection")
            buf += data
            if need < 0 and (end := buf.find(b"\r\n\r\n")) >= 0:
                head = bytes(buf[:end]).decode("latin-1").split("\r\n")
                status = int(head[0].split(" ", 2)[1])
                length = next((int(h.split(":", 1)[1]) for h in head[1:] if h.lower().startswith("content-length:")),
                              None)
                if length is None:
                    raise ValueError(f"HTTP {status} reply without Content-Length")
                start = end + 4
                need = start + length
                if any(h.lower().startswith("connection:") and "close" in h.lower() for h in head[1:]):
                    self.sock = None         # the server ends this connection after the reply
                    loop.call_soon(sock.close)
        return status, bytes(buf[start:need])

    async def _recv(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bytes:
        """One read; notes the kernel's receive time of what it read."""
        while True:
            try:
                data, anc, _, _ = sock.recvmsg(65536, _CMSG_SPACE)
            except BlockingIOError:
                ready: asyncio.Future[None] = loop.create_future()
                loop.add_reader(sock.fileno(), _wake, ready)
                try:
                    await ready
                finally:
                    loop.remove_reader(sock.fileno())
                continue
            for level, kind, raw in anc:
                if level == socket.SOL_SOCKET and kind == SCM_TIMESTAMPNS:
                    sec, nsec = _TIMESPEC.unpack(raw[:_TIMESPEC.size])
                    self.arrived = sec + nsec * 1e-9 - (time.time() - time.monotonic())
            return data


def _wake(ready: asyncio.Future[None]) -> None:
    if not ready.done():
        ready.set_result(None)
