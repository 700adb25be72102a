"""A cap on open connections that a flood of idle ones cannot turn against agents and /healthz.

Past `max_connections` idle connections are closed, so an agent or a health check always gets in: first
those that never had a request answered (a flood's; oldest first; a refusal or /healthz counts for nothing),
then the longest idle of the others (an agent's keep-alive connection outlives a flood opened after it); never
one with a request in progress, such as a held long-poll. At the hard limit below the open-file limit, with none
idle, a held long-poll gives way (delivery/give_way.py); a newcomer is refused only when none can, so accepting never
fails with "Too many open files"; a TLS newcomer's room is made once its handshake is done. A body over
MAX_BODY_BYTES is refused (413) unread, one not in within BODY_TIMEOUT_S (400); the rest of a body left unread by an
answer is read DRAIN_BYTES at most, then its connection closed, not read on through aiohttp's "lingering" close.
Request heads are bounded in time and bytes (heads.py).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from protocol.codec import MAX_BODY_BYTES
from protocol.errors import ErrorCode
from protocol.quoting import quote
from rdzv_server import logs, tcp_info
from rdzv_server.core.errors import RendezvousError
from rdzv_server.web.heads import Heads, unwrapped

log = logging.getLogger("rdzv_server")

BODY_TIMEOUT_S = 10.0       # a request body slower than this is refused (a slow-body client holds nothing)
DRAIN_BYTES = MAX_BODY_BYTES  # after an answer sent before its body was in, the most of it read (send_and_close)
DRAIN_S = 2.0
FD_RESERVE = 256            # descriptors kept free for the store, logs and the like
# request key: its connection's ack age when it ended (a typed key where aiohttp has them: 3.12 on)
CLOSED_ACK_AGE: Any = (web.RequestKey("closed_ack_age_s", object) if hasattr(web, "RequestKey")
                       else "rdzv.closed_ack_age_s")
HANG_UP: Any = web.RequestKey("hang_up", bool) if hasattr(web, "RequestKey") else "rdzv.hang_up"
GIVE_WAY_SLACK = 32         # connections accepted past the hard limit while the polls that gave way close
ARRIVING_S = 1.0            # a connection this new with its request unread is closed last to make room
FRESH_S = 10.0              # a connection accepted but not yet connected (TLS handshake) counts this long


class _Refused(asyncio.Protocol):
    """The protocol of a connection over the cap with nobody idle to make room: closed at once."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


class ConnectionGuard:
    """`max_connections`: the cap kept by closing idle connections (checked after each
    accept); `hard_limit`: past it a new connection is refused at once (never reach the open-file limit)."""

    def __init__(self, max_connections: int, hard_limit: int | None = None) -> None:
        self.max_connections = max_connections
        self.hard_limit = max(hard_limit or max_connections, max_connections)
        self.refused = 0
        self.evicted = 0
        self.give_way: Callable[[], bool] | None = None     # a held poll answered to make room (the hub's)
        self.close_a_handshake: Callable[[], bool] | None = None    # the TLS port's longest waiting one closed
        self._busy: dict[Any, web.Request] = {}          # protocols with a request in progress: it
        # Kept here, O(1) per accept: aiohttp's `Server.connections` copies the list of every open one.
        self._unproven: dict[Any, float] = {}            # connected, no request finished yet: oldest first; when
        self._open: dict[Any, float] = {}                # connected, a request finished: longest idle first; when
        self._fresh: dict[Any, float] = {}               # handlers made, not yet connected: when
        self._closed_for_room: set[Any] = set()          # closed by _make_room, until their end is told
        self._trim_soon = False
        self.heads = Heads(lambda handler: handler in self._busy)

    def factory(self, server: web.Server, evict: bool = True) -> Callable[[], asyncio.BaseProtocol]:
        """Wrap aiohttp's protocol factory (`AppRunner.server`), following the connections it makes and loses.
        `evict=False` (a TLS port's, asked as a handshake starts): at the hard limit room is made once the
        newcomer's handshake is done, not for a handshake that may never end (`_handshake_past_limit`)."""
        made, lost = server.connection_made, server.connection_lost

        def on_made(handler: Any, transport: asyncio.Transport) -> None:
            self._fresh.pop(handler, None)
            if (not evict and len(self._open) + len(self._unproven) >= self.hard_limit
                    and not (self._make_room() or (self.give_way is not None and self.give_way()))):
                self.refused += 1           # nobody idle, no held poll: the newcomer goes after all
                made(handler, transport)
                close_now(transport)
                return
            self._unproven[handler] = time.monotonic()
            made(handler, transport)

        def on_lost(handler: Any, exc: BaseException | None = None) -> None:
            self._closed_for_room.discard(handler)
            self._open.pop(handler, None)
            self._unproven.pop(handler, None)
            self._fresh.pop(handler, None)
            if (request := self._busy.get(handler)) is not None:  # its socket stays open until after this: ask now
                age = ack_age_s(handler.transport)
                if age is None and closed_by_peer(exc):
                    age = 0.0     # TLS tells after its socket closed: a FIN or RST is the peer's host, just now
                request[CLOSED_ACK_AGE] = age
            lost(handler, exc)

        server.connection_made = on_made      # type: ignore[method-assign]
        server.connection_lost = on_lost      # type: ignore[method-assign]

        def make() -> asyncio.BaseProtocol:
            # asyncio accepts in batches and connects them (after TLS: their handshakes) later:
            # count those too for a while, so a burst cannot slip past the limits.
            now = time.monotonic()
            while self._fresh and now - next(iter(self._fresh.values())) >= FRESH_S:
                del self._fresh[next(iter(self._fresh))]      # never connected (a failed handshake)
            count = len(self._open) + len(self._unproven) + len(self._fresh)
            if count >= self.hard_limit and not self._room_at_limit(count, evict):
                self.refused += 1
                return _Refused()
            if count >= self.max_connections and not self._trim_soon:
                self._trim_soon = True
                asyncio.get_running_loop().call_later(0.05, self._trim)
            handler = server()
            self._fresh[handler] = now
            return self.heads.wrap(handler)
        return make

    def not_connected(self, handler: Any) -> None:
        """A handler made whose connection never connected (a TLS handshake refused or too slow): not counted."""
        self._fresh.pop(unwrapped(handler), None)

    def _trim(self) -> None:
        self._trim_soon = False
        excess = len(self._open) + len(self._unproven) - self.max_connections
        while excess > 0 and self._make_room():
            excess -= 1

    def _make_room(self) -> bool:
        """Close the first idle connection (lazily: unproven ones first, then the longest idle); one whose request
        is arriving (connected or answered under ARRIVING_S ago, its next request unread in its socket or read and
        not yet handled) last: a newcomer (an agent reconnecting after its poll gave way) taken for idle was closed
        by the next newcomer of the same accept batch, over and over (a review: a member lost under a flood of
        polls). Still before any held poll gives way: sparing them for good let strangers' fresh connections make
        members' polls give way (a second review: members lost). A TLS connection closing (waiting up to SHUTDOWN_S
        for its peer's close_notify, counted all along) is ended as an idle one is: else a stranger asking with
        `Connection: close` and never answering the close_notify filled the limit, and members' polls gave way to
        its newcomers (a review: nodes lost)."""
        now = time.monotonic()
        arriving = None
        for handler, since in itertools.chain(self._unproven.items(), self._open.items()):
            transport = handler.transport
            if handler in self._busy or transport is None or handler in self._closed_for_room:
                continue
            if transport.is_closing():
                if transport.get_extra_info("sslcontext") is None:
                    continue                                # a plain one is gone in a turn
            elif now - since < ARRIVING_S and (request_read(handler) or tcp_info.unread_bytes(transport) > 0):
                arriving = arriving or handler              # the oldest such
                continue
            self._close_for_room(handler)
            return True
        if arriving is None:
            return False
        self._close_for_room(arriving)
        return True

    def _close_for_room(self, handler: Any) -> None:
        self._closed_for_room.add(handler)
        close_now(handler.transport)
        self.evicted += 1

    def _room_at_limit(self, count: int, evict: bool) -> bool:
        """Whether a newcomer at the hard limit is taken: room made now (an idle one closed, else a held poll gives
        way), or, for a TLS port's, once its handshake is done."""
        if evict:
            return self._make_room() or self._held_gives_way(count)
        return self._handshake_past_limit(count)

    def _handshake_past_limit(self, count: int) -> bool:
        """Whether a TLS handshake starts at the hard limit: its room is made when it is done (`on_made`). Refusing it
        let a stranger's idle connections, handshakes done and no token needed, shut every agent out (a review). At
        most GIVE_WAY_SLACK past the limit; there the TLS port's longest waiting handshake is closed for it."""
        return count < self.hard_limit + GIVE_WAY_SLACK or (self.close_a_handshake is not None
                                                            and self.close_a_handshake())

    def _held_gives_way(self, count: int) -> bool:
        """A held poll gives way (closed once answered): at most GIVE_WAY_SLACK past the hard limit meanwhile."""
        return count < self.hard_limit + GIVE_WAY_SLACK and self.give_way is not None and self.give_way()

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        """Marks a connection busy while it has a request in progress (a held long-poll is busy)."""
        protocol = request.protocol
        self._busy[protocol] = request
        answered = 500
        try:
            response = await handler(request)
            answered = response.status
            return response
        finally:
            self._busy.pop(protocol, None)
            # Idle from now, the last of those closed to make room; a connection proves itself by a request it was
            # entitled to (a refusal, or /healthz which anyone may ask, proves nothing).
            proven = answered < 400 and request.path != "/healthz"
            if protocol in self._open or (proven and self._unproven.pop(protocol, None) is not None):
                self._open.pop(protocol, None)
                self._open[protocol] = time.monotonic()


def close_now(transport: asyncio.BaseTransport) -> None:
    """Close a connection to make room, its descriptor free at once: a TLS one aborted, not shut down (a closed TLS
    connection waits up to SHUTDOWN_S for its peer's close_notify, counted all along: a stranger's idle ones, each
    closed for a newcomer, still filled the limit and the newcomers after were refused)."""
    if transport.get_extra_info("sslcontext") is not None:
        transport.abort()      # type: ignore[attr-defined]
    else:
        transport.close()


def request_read(handler: Any) -> bool:
    """Whether aiohttp has read a request on this connection while it was idle, and has not taken it up yet (a turn
    of the event loop later): without it, a request read in the same turn as a newcomer's accept looked idle and was
    closed (a review: 86 times in one flood). Not a connection at work on requests it pipelined (its queue is not
    empty for as long as it sends more): sparing those let a stranger's flood outlast the newcomers (a review).
    aiohttp's own fields (its handler waits on `_waiter` while idle); False where they differ."""
    waiting = getattr(handler, "_waiter", None)
    return waiting is not None and bool(getattr(handler, "_messages", None))


GUARD = web.AppKey("connection_guard", ConnectionGuard)     # the server's (an app alone has none)


def hang_up(request: web.Request) -> None:
    """Have the request's connection closed once its reply is out (a held poll that gave way: app.py)."""
    request[HANG_UP] = True


def closed_by_peer(exc: BaseException | None) -> bool:
    """Whether a connection ended by its peer's host: a FIN (no error) or a reset, not a keepalive or a
    retransmission giving up (ETIMEDOUT, EHOSTUNREACH: the path is silent)."""
    return exc is None or isinstance(exc, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError))


def local_address(transport: asyncio.BaseTransport | None) -> str:
    """The server's own address on this connection (where the node reached it); "" where unknown."""
    sockname = transport.get_extra_info("sockname") if transport is not None else None
    return str(sockname[0]) if sockname else ""


def ack_age_s(transport: asyncio.BaseTransport | None) -> float | None:
    """How long ago the peer last showed that it and the path work (its last ACK, keepalive answers too)."""
    info = tcp_info.of(transport)
    return None if info is None else info.last_ack_recv_s


def closed_by_peer_now(transport: asyncio.BaseTransport | None) -> bool:
    """Whether the peer's FIN is in and not yet read (tcp_info.TcpInfo.closed_by_peer); False where unknown."""
    info = tcp_info.of(transport)
    return info is not None and info.closed_by_peer


def request_waited_s(request: web.Request) -> float:
    """How long the request waited for the server since its last bytes arrived; 0.0 where unknown and when
    pipelined (sent before the previous reply): that wait was the client's choice, not the server's lag."""
    info = tcp_info.of(request.transport)
    return info.last_data_recv_s if info is not None and info.last_data_sent_s >= info.last_data_recv_s else 0.0


def request_ack_age_s(request: web.Request) -> float | None:
    """`ack_age_s` of the request's connection; once it ended, as it was then (a FIN or RST just in: ~0)."""
    if CLOSED_ACK_AGE in request:
        age: float | None = request[CLOSED_ACK_AGE]
        return age
    return ack_age_s(request.transport)


class ClientGone(web.HTTPClientError):
    """The client closed its connection before its body arrived: counted as 499 (nginx's "client closed")."""
    status_code = 499


class SlowBody(RendezvousError):
    """A body that did not arrive in time: the refusal is sent, then the connection closed."""


async def send_and_close(request: web.Request, response: web.StreamResponse) -> None:
    """Send `response` now, then read what is left of the body, DRAIN_BYTES within DRAIN_S at most: the connection
    stays where it all came (its client still sending reads the answer, and may ask again on it), else it is closed.
    Closed unread, a client sending a body in pieces (a 415, a 403 for its Host, answered on the head) got a broken
    pipe for the answer; read on by aiohttp ("lingering", 10 s, no cap), an endless body took ~330 MiB/s."""
    await response.prepare(request)
    await response.write_eof()
    left = request.content_length
    if (left is None or left <= DRAIN_BYTES) and await _drained(request):
        return
    request.protocol.force_close()


async def _drained(request: web.Request) -> bool:
    """The rest of the body read and dropped, DRAIN_BYTES within DRAIN_S at most: whether it all came."""
    async def drain() -> bool:
        taken = 0
        while piece := await request.content.readany():
            taken += len(piece)
            if taken > DRAIN_BYTES:
                return False
        return True
    try:
        return await asyncio.wait_for(drain(), DRAIN_S)
    except (asyncio.TimeoutError, ConnectionError, web.RequestPayloadError):
        return False


async def read_body(request: web.Request) -> bytes:
    """The request's body, or a refusal when it announces more than MAX_BODY_BYTES (a chunked one:
    aiohttp's 413), does not arrive in BODY_TIMEOUT_S or cannot be read; a client gone is one log line."""
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise RendezvousError(ErrorCode.TOO_LARGE, f"the body announces {request.content_length} bytes "
                              f"(Content-Length); at most {MAX_BODY_BYTES} are accepted")
    try:
        if request.content.is_eof():     # all of it came with the headers (nearly every agent request):
            return await request.read()  # read at once, without wait_for's task and timer
        return await asyncio.wait_for(_bounded(request), BODY_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise SlowBody(ErrorCode.BAD_REQUEST, f"the request body did not arrive within "
                       f"{BODY_TIMEOUT_S:g}s") from None
    except ConnectionError as exc:
        logs.say_client_fault(log, "client %s closed the connection before its request body arrived (%s %s): %s",
                              request.remote, request.method, quote(request.path), exc)
        raise ClientGone() from None
    except web.RequestPayloadError as exc:
        raise RendezvousError(ErrorCode.BAD_REQUEST, f"the request body could not be read: {exc}") from None


async def _bounded(request: web.Request) -> bytes:
    """The body read piece by piece, refused once past MAX_BODY_BYTES (a chunked body announces no length). The
    refusal's traceback keeps this frame, in a cycle with the wait_for task that a tick may have frozen
    (gc_tuning.py): what was read is dropped first. A review: aiohttp's read() kept each refused body's MiB and
    more until the hourly collection, 40 endless chunked bodies a wave, RSS 47 -> 309 -> 580 -> 825 MiB."""
    body = bytearray()
    while piece := await request.content.readany():
        if len(body) + len(piece) > MAX_BODY_BYTES:
            del body, piece
            raise RendezvousError(ErrorCode.TOO_LARGE, f"the body exceeds {MAX_BODY_BYTES} bytes")
        body += piece
    return bytes(body)
