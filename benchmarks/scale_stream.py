"""A lean stream transport for simulated nodes (`bench_scale.py --transport stream`).

The stream as docs/protocol.md specifies it (one WebSocket per node, MessagePack frames), spoken
with plain sockets for the reason scale_wire.py gives for HTTP: aiohttp's client would cost the
fleet more CPU than the server it measures on the 2-core machine. Each frame is read with `recvmsg`
and SO_TIMESTAMPNS, so a pushed round is timed by when the kernel received it. Client frames are
masked with a zero key (RFC 6455 requires the mask bit; a zero key leaves the payload as it is).
Heartbeats are sent for the whole process by `Fleet` (one timer, not one per node).
"""
from __future__ import annotations

import asyncio
import base64
import itertools
import os
import socket
import struct
import time

import msgspec

from benchmarks.scale_wire import WireClient
from node_agent.client.deadline import deadline
from node_agent.client.transport import ServerUnreachable, bound_unacked_sends, refusal
from protocol.codec import encode
from protocol.messages import PROTOCOL_VERSION, NodeStatus, PollRequest, poll_ready
from protocol.stream import (
    Error,
    Heartbeat,
    Hello,
    Reply,
    Request,
    Status,
    Subscribe,
    decode_server_frame,
    encode_frame,
)


def client_frame(payload: bytes) -> bytes:
    n = len(payload)
    if n < 126:
        head = bytes((0x82, 0x80 | n))
    elif n < 1 << 16:
        head = struct.pack("!BBH", 0x82, 0x80 | 126, n)
    else:
        head = struct.pack("!BBQ", 0x82, 0x80 | 127, n)
    return head + b"\x00\x00\x00\x00" + payload


HEARTBEAT = client_frame(encode_frame(Heartbeat()))


class StreamWire(WireClient):
    """The agent's Transport over one stream per node (WireClient lends it the socket and the timed reads)."""

    def __init__(self, port: int, job_id: str, node_id: str, source: str) -> None:
        super().__init__(port, job_id, node_id, source)
        self.url_path = f"/v1/jobs/{job_id}/stream"
        self.pending: dict[int, asyncio.Future[tuple[Reply, float]]] = {}
        self.latest: NodeStatus | None = None
        self.latest_at = 0.0
        self.news = asyncio.Event()
        self.broken = False
        self.subscribed: str | None = None
        self.reader: asyncio.Task[None] | None = None
        self.lease_s = 5.0
        self.opened_at = 0.0            # when the stream now open was opened (time.monotonic())
        self._ids = itertools.count()

    def holding(self, since: float) -> tuple[bool, bool]:
        """(subscribed and told its view on an open stream, and that stream opened after `since`)."""
        up = self.sock is not None and not self.broken and self.subscribed is not None and self.latest is not None
        return up, up and self.opened_at >= since

    def close(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
            self.reader = None
        super().close()
        self.broken, self.subscribed = False, None
        _fail(self.pending, "the stream was closed")

    def beat(self) -> None:
        # only once `hello` went out (the reader starts then): a heartbeat first breaks the protocol, and
        # the server closes the stream (in a slow join storm that made every node reconnect, over and over)
        if self.sock is not None and self.reader is not None and not self.broken:
            try:
                self.sock.send(HEARTBEAT)
            except OSError:
                pass       # a full socket buffer or a closed stream: the reader finds out

    async def _open(self) -> socket.socket:
        sock = await self._connect()
        bound_unacked_sends(sock)        # as the agent's stream: unacknowledged heartbeats end a dead path
        self.sock = sock
        self.opened_at = time.monotonic()
        loop = asyncio.get_running_loop()
        key = base64.b64encode(os.urandom(16)).decode()
        await loop.sock_sendall(sock, (f"GET {self.url_path} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
                                       f"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                                       f"Sec-WebSocket-Version: 13\r\n\r\n").encode())
        buf = bytearray()
        while (end := buf.find(b"\r\n\r\n")) < 0:
            data = await self._recv(loop, sock)
            if not data:
                raise ConnectionResetError("the server closed the connection during the upgrade")
            buf += data
        status = bytes(buf[:end]).split(b" ", 2)[1]
        if status != b"101":
            raise ValueError(f"upgrade refused: HTTP {status.decode()}")
        await loop.sock_sendall(sock, client_frame(encode_frame(Hello(v=PROTOCOL_VERSION, node_id=self.node_id))))
        self.reader = asyncio.create_task(self._read(sock, buf[end + 4:]))
        return sock

    async def _send(self, action: str, message: object, timeout: float) -> NodeStatus:
        try:
            async with deadline(timeout):
                if self.sock is None or self.broken:
                    self.close()
                    await self._open()
                assert self.sock is not None
                if isinstance(message, PollRequest):
                    return await self._poll(self.sock, message)
                rid = next(self._ids)
                fut: asyncio.Future[tuple[Reply, float]] = asyncio.get_running_loop().create_future()
                self.pending[rid] = fut
                frame = Request(id=rid, action=action, body=msgspec.Raw(encode(message)))
                await asyncio.get_running_loop().sock_sendall(self.sock, client_frame(encode_frame(frame)))
                reply, at = await fut
        except (OSError, asyncio.TimeoutError, ValueError) as exc:
            self.close()
            raise ServerUnreachable(f"{type(exc).__name__}: {exc}".rstrip(": ")) from exc
        if reply.error is not None:
            raise refusal(reply.error.code, reply.error.message)
        assert reply.status is not None
        self.arrived, self.lease_s = at, reply.status.lease_timeout_s
        return reply.status

    async def _poll(self, sock: socket.socket, req: PollRequest) -> NodeStatus:
        if self.subscribed != req.credential:
            self.subscribed, self.latest = req.credential, None
            frame = Subscribe(credential=req.credential, known_round=req.known_round, master_port=req.master_port)
            await asyncio.get_running_loop().sock_sendall(sock, client_frame(encode_frame(frame)))
        loop = asyncio.get_running_loop()
        ends = loop.time() + req.wait_s
        while True:
            if self.broken:
                raise ConnectionResetError("the server closed the stream")
            latest = self.latest
            if latest is not None and (poll_ready(latest, req.known_round) or loop.time() >= ends):
                self.arrived = self.latest_at
                return latest
            self.news.clear()
            try:
                await asyncio.wait_for(self.news.wait(), max(0.0, ends - loop.time()) if latest else None)
            except asyncio.TimeoutError:
                pass

    async def _read(self, sock: socket.socket, buf: bytearray) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                while (frame := _take_frame(buf)) is not None:
                    self._on_frame(*frame)
                data = await self._recv(loop, sock)
                if not data:
                    break
                buf += data
        except (OSError, ValueError):     # ValueError: the socket was closed under the read (close())
            pass
        self.broken = True
        _fail(self.pending, "the server closed the stream")
        self.news.set()

    def _on_frame(self, opcode: int, payload: bytes) -> None:
        if opcode == 0x8:
            self.broken = True
            return
        if opcode != 0x2:
            return
        frame = decode_server_frame(payload)
        if isinstance(frame, Reply):
            fut = self.pending.pop(frame.id, None)
            if fut is not None and not fut.done():
                fut.set_result((frame, self.arrived))
        elif isinstance(frame, Status):
            self.latest, self.latest_at, self.lease_s = frame.status, self.arrived, frame.status.lease_timeout_s
            self.news.set()
        elif isinstance(frame, Error):
            self.broken = True


def _fail(pending: dict[int, asyncio.Future[tuple[Reply, float]]], why: str) -> None:
    """Fail the requests awaiting a reply (one whose caller gave up already: marked seen, not logged)."""
    for fut in pending.values():
        if not fut.done():
            fut.set_exception(ConnectionResetError(why))
            fut.exception()
    pending.clear()


def _take_frame(buf: bytearray) -> tuple[int, bytes] | None:
    """The first whole (unmasked, server) frame in `buf`, removed from it; None until one is in."""
    if len(buf) < 2:
        return None
    n, at = buf[1] & 0x7F, 2
    if n == 126:
        if len(buf) < 4:
            return None
        n, at = struct.unpack_from("!H", buf, 2)[0], 4
    elif n == 127:
        if len(buf) < 10:
            return None
        n, at = struct.unpack_from("!Q", buf, 2)[0], 10
    if len(buf) < at + n:
        return None
    opcode, payload = buf[0] & 0x0F, bytes(buf[at:at + n])
    del buf[:at + n]
    return opcode, payload
