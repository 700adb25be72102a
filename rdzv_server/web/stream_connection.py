"""One node's stream once upgraded: its WebSocket read and written on the bare transport.

aiohttp parses the upgrade request and runs it through the app's middlewares (token, origins,
standby); `adopt` then answers the handshake (`handshake`), gives the transport to a
StreamConnection and lets aiohttp's handler go. A stream so costs the server 4.9 KiB, its node's
records included, where aiohttp's WebSocket kept 19 KiB alive for the stream's life (the request,
its handler, reader, writer, queue, and a task suspended in the middlewares): `make
bench-stream-memory`, 10,000 streams 94 MiB against 232.

Framing: the `websockets` library's sans-I/O protocol reads the node's frames (unmasking,
fragments, pings, the close handshake, the size bound). Frames to the node are written here
(`ws_frame`: 0.6 us a frame against the library's 3 us, in a fan-out to 10,000 nodes). Messages
are handled one at a time, in order: while one is awaited (a request), reading pauses.
"""
from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import struct
from collections.abc import Awaitable, Callable

from aiohttp import web
from websockets.exceptions import PayloadTooBig
from websockets.frames import Frame, Opcode
from websockets.protocol import Protocol as WebSocket
from websockets.protocol import Side, State

from protocol.codec import DecodeError
from protocol.errors import ErrorCode
from protocol.quoting import quote
from protocol.stream import Error, FrameError, encode_frame
from rdzv_server.streams import StreamHub, Subscription
from rdzv_server.web.connections import GUARD, TCP_INFO_LAST_DATA_RECV, ConnectionGuard, tcp_info_age_s

log = logging.getLogger("rdzv_server")
# websockets logs each connection opened and closed (INFO) and each frame (DEBUG): not ours to show
WS_LOG = logging.getLogger("rdzv_server.websockets")
WS_LOG.setLevel(logging.WARNING)

# What a message means is the caller's: it returns an awaitable for a message that takes one (a
# request), None otherwise, and raises FrameError for one that breaks the protocol.
OnMessage = Callable[["StreamConnection", bytes], "Awaitable[None] | None"]
WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"     # RFC 6455 1.3
CLOSE_LINGER_S = 2.0
_CLOSE_CODES = {ErrorCode.TOO_LARGE: 1009, ErrorCode.SHUTTING_DOWN: 1001}   # RFC 6455 7.4.1; else 1008


def ws_frame(payload: bytes, opcode: int = 0x2) -> bytes:
    """One unmasked, final WebSocket frame (RFC 6455 5.2): binary by default."""
    n = len(payload)
    if n < 126:
        return bytes((0x80 | opcode, n)) + payload
    if n < 1 << 16:
        return struct.pack("!BBH", 0x80 | opcode, 126, n) + payload
    return struct.pack("!BBQ", 0x80 | opcode, 127, n) + payload


def handshake(request: web.Request) -> bytes:
    """The 101 answer to a WebSocket upgrade request (RFC 6455 4.2); a refusal (400) naming what is
    wrong when it is not one. (Here rather than websockets' ServerProtocol.accept: 3 us against 111 us a
    stream, 1 s of the server's loop in a 10,000-node join storm.)"""
    headers = request.headers
    key = headers.get("Sec-WebSocket-Key", "")
    if headers.get("Upgrade", "").lower() != "websocket":
        problem = "no `Upgrade: websocket` header"
    elif "upgrade" not in (token.strip().lower() for token in headers.get("Connection", "").split(",")):
        problem = "no `Connection: Upgrade` header"
    elif headers.get("Sec-WebSocket-Version", "") != "13":
        problem = f"Sec-WebSocket-Version {quote(headers.get('Sec-WebSocket-Version', ''))}: 13 is spoken here"
    elif not _key_ok(key):
        problem = f"Sec-WebSocket-Key {quote(key)} is not 16 bytes in base64"
    else:
        accept = base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest())
        return b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n" \
               b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n"
    raise DecodeError(ErrorCode.BAD_REQUEST, f"this route takes a WebSocket upgrade (docs/protocol.md): {problem}")


def _key_ok(key: str) -> bool:
    try:
        return len(key) == 24 and len(base64.b64decode(key, validate=True)) == 16
    except ValueError:
        return False


def websocket(max_frame: int) -> WebSocket:
    """The reader of an upgraded connection's frames (the handshake done)."""
    return WebSocket(Side.SERVER, state=State.OPEN, max_size=max_frame, logger=WS_LOG)


class StreamConnection(asyncio.Protocol):
    """The hub's `Stream` over one upgraded connection (push, close, kernel silence) and the
    reader of its frames."""

    __slots__ = ("ws", "transport", "hub", "on_message", "cap", "remote", "local", "sub", "_waiting", "_task",
                 "_parts", "_text", "_closing", "_guard")

    def __init__(self, ws: WebSocket, transport: asyncio.Transport, hub: StreamHub, job_id: str,
                 on_message: OnMessage, cap: int, remote: str, local: str) -> None:
        self.ws, self.transport, self.hub, self.on_message, self.cap = ws, transport, hub, on_message, cap
        self.remote, self.local = remote, local
        self.sub: Subscription = hub.opened(job_id, "", self)
        self._waiting: list[Frame] | None = None       # frames read while a message is awaited
        self._task: asyncio.Task[None] | None = None
        self._parts: list[bytes] | None = None          # a fragmented message so far
        self._text = False
        self._closing = False                           # the server has sent its close
        self._guard: ConnectionGuard | None = None

    # -- the hub's side --
    def push(self, frame: bytes) -> bool:
        t = self.transport
        if self._closing or t.is_closing():
            return False
        t.write(ws_frame(frame))
        return t.get_write_buffer_size() <= self.cap

    def close(self, code: ErrorCode, message: str, leader: str = "") -> None:
        """The error frame and the close; then what the node still sends is read and dropped until
        its close (or its EOF) comes, for at most CLOSE_LINGER_S: closing on unread data would send
        an RST, which can discard the error frame before the node reads it."""
        t = self.transport
        if self._closing or t.is_closing():
            return
        self._closing = True
        if t.get_write_buffer_size() > self.cap:
            t.abort()            # it does not read: nothing more can reach it
            return
        t.write(ws_frame(encode_frame(Error(code=code.value, message=message, leader=leader))))
        t.write(ws_frame(struct.pack("!H", _CLOSE_CODES.get(code, 1008)), 0x8))
        if code is ErrorCode.SHUTTING_DOWN:
            t.close()            # the server is going away: it waits for nobody
            return
        t.resume_reading()
        asyncio.get_running_loop().call_later(CLOSE_LINGER_S, t.abort)

    def kernel_silence_s(self) -> float:
        age = tcp_info_age_s(self.transport, TCP_INFO_LAST_DATA_RECV)
        return float("inf") if age is None else age

    # -- taking the connection over --
    def adopt(self, request: web.Request, answer: bytes) -> None:
        """Answer the handshake and read the connection from now on. aiohttp's handler lets go of
        it (no longer writes to or closes it) and, once its request has ended, forgets it; the
        server's connection guard counts it as a stream until it closes."""
        aiohttp_handler, t = request.protocol, self.transport
        t.write(answer)
        t.set_protocol(self)
        t.resume_reading()                 # in case aiohttp had paused it
        aiohttp_handler.transport = None
        # (done callbacks run in order: aiohttp's own, which ends its connection loop, first)
        request.task.add_done_callback(lambda _: aiohttp_handler.connection_lost(None))
        self._guard = request.app.get(GUARD)
        if self._guard is not None:
            self._guard.stream_opened(self)

    # -- asyncio.Protocol --
    def data_received(self, data: bytes) -> None:
        ws = self.ws
        if self._closing:           # the server has closed: dropped, until the node's close (see close)
            self._lingering(data)
            return
        try:
            ws.receive_data(data)
            frames = [event for event in ws.events_received() if isinstance(event, Frame)]
            if ws.parser_exc is not None:
                self._broken(ws.parser_exc)
                return
            self._take(frames)
            for chunk in ws.data_to_send():     # pongs, and the answer to the node's close
                if chunk:
                    self.transport.write(chunk)
                else:
                    self.transport.close()
        except Exception:  # a bug: logged, the node told without a traceback
            self._internal()

    def eof_received(self) -> bool | None:
        return None                           # the transport closes itself

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._task is not None:
            self._task.cancel()
        self._waiting = None
        self.hub.closed(self.sub)
        if self._guard is not None:
            self._guard.stream_closed(self)

    def _lingering(self, data: bytes) -> None:
        ws = self.ws
        try:
            ws.receive_data(data)
            if any(isinstance(event, Frame) and event.opcode is Opcode.CLOSE for event in ws.events_received()):
                self.transport.close()
            ws.data_to_send()        # (websockets' own answer: ours is sent)
        except Exception:  # noqa: BLE001 - nothing more is read from it either way
            self.transport.close()

    # -- frames --
    def _take(self, frames: list[Frame]) -> None:
        for i, frame in enumerate(frames):
            if self._waiting is not None:
                self._waiting.extend(frames[i:])
                return
            if self._closing or self.transport.is_closing():
                return
            self._frame(frame)

    def _frame(self, frame: Frame) -> None:
        if frame.opcode is Opcode.TEXT or frame.opcode is Opcode.BINARY:
            self._text = frame.opcode is Opcode.TEXT       # (websockets checks the fragments' order)
        elif frame.opcode is not Opcode.CONT:
            return                 # ping, pong, close: answered by websockets
        if not frame.fin:
            if self._parts is None:
                self._parts = []
            self._parts.append(bytes(frame.data))    # (not a new list each time: 1-byte fragments)
            return
        payload = b"".join((*self._parts, frame.data)) if self._parts else bytes(frame.data)
        self._parts = None
        self.hub.heard(self.sub)
        try:
            if self._text:
                raise FrameError(ErrorCode.BAD_REQUEST,
                                 "frames are binary WebSocket messages holding a MessagePack map")
            pending = self.on_message(self, payload)
        except FrameError as exc:
            self._refuse(exc)
            return
        except Exception:  # a bug: logged, the node told without a traceback
            self._internal()
            return
        if pending is not None:
            self._waiting = []
            self.transport.pause_reading()
            self._task = asyncio.ensure_future(self._finish(pending))

    async def _finish(self, pending: Awaitable[None]) -> None:
        try:
            await pending
        except FrameError as exc:
            self._refuse(exc)
        except Exception:  # (a cancel, the connection lost, is not one: it ends here)
            self._internal()
        self._task = None
        waiting, self._waiting = self._waiting, None
        if waiting is None or self._closing or self.transport.is_closing():
            return
        self._take(waiting)
        if self._waiting is None:
            self.transport.resume_reading()

    def _refuse(self, exc: FrameError) -> None:
        self.hub.end(self.sub, exc.code, exc.message, f"bad frame: {exc.code.value}")

    def _internal(self) -> None:
        log.exception("internal error on a stream of job %s", quote(self.sub.job_id))
        self.hub.end(self.sub, ErrorCode.INTERNAL, "internal server error (logged on the server)", "internal")

    def _broken(self, exc: Exception) -> None:
        """Not WebSocket (a bad frame header, an unmasked frame, a message over the size bound)."""
        if isinstance(exc, PayloadTooBig):
            self._refuse(FrameError(ErrorCode.TOO_LARGE, f"message too large: {exc}"))
        else:
            self._refuse(FrameError(ErrorCode.BAD_REQUEST, f"not a WebSocket frame: {quote(str(exc))}"))
