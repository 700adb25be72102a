"""A listener that faces strangers: the agent's witness port (peer copies in the clear come there too) and its TLS
port for peer copies. Anyone who can reach the node can connect, so each connection is bounded before it costs
more than a descriptor, as the server bounds its own TLS port's (protocol/accepting.py: the caps, the accept loop):
- at most MAX_CONNECTIONS open for all of the agent's listeners together, and MAX_PER_SOURCE from one address; a
  connection waits until its first line is in (idle connections cannot shut out a witness's question or a copy);
- a TLS handshake, started once the peer's ClientHello came, done within HANDSHAKE_S, then the first line within
  FIRST_LINE_S (4 s each), read into a buffer of FIRST_LINE_LIMIT bytes (a real first line is under 512); what
  breaks either is closed without a word.
The handler gets the first line and the connection; it may widen the reader's buffer for a payload
(node_agent.copies.stream.widen); the connection is closed when it returns."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable

from protocol import keepalive
from protocol.accepting import MIN_TOTAL, Accepted, Caps, SayOnce, accept

MAX_CONNECTIONS = 512     # open at once, for all the agent's listeners (and a quarter of its descriptors at most)
MAX_PER_SOURCE = 64       # open at once from one address (a node pushes, fetches and asks with a few each)
HANDSHAKE_S = 4.0       # within the 5 s an operator is promised, with a margin for a loaded machine
FIRST_LINE_S = 4.0
FIRST_LINE_LIMIT = 1024   # the reader's buffer until the first line is in: a longer line ends the connection
HANDSHAKES_SHARE = 4      # TLS handshakes at once: a quarter of the total cap at most (each holds ~1 MiB)
KNOWN_PEERS = 1024        # sources a handshake was done from, remembered (their handshakes go before strangers')
CLOSE_S = 2.0             # a served connection's close (a TLS peer's close_notify, a reader taking the last bytes):
                          # then aborted. Counted in the caps until then: a peer that never answers holds no more

Handler = Callable[[bytes, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def caps_for_descriptors(limit: int) -> Caps:
    """Caps that leave three quarters of `limit` descriptors to the rest of the agent (workers, pipes, polls), and
    one source at most half the total: a review at 256 descriptors (a total of 64, as the source cap) saw one address
    hold every connection at work and a peer's push refused."""
    total = max(MIN_TOTAL, min(MAX_CONNECTIONS, limit // 4))
    return Caps(total=total, per_source=min(MAX_PER_SOURCE, total // 2), shrinks=True)


def agent_caps() -> Caps:
    return Caps(MAX_CONNECTIONS, MAX_PER_SOURCE, shrinks=True)


async def _first_line(loop: asyncio.AbstractEventLoop, accepted: Accepted) -> tuple[bytes, bytes]:
    """(the first line with its newline, what came after it), or (b"", b"") when the peer closed or sent a line
    longer than FIRST_LINE_LIMIT."""
    got = b""
    while b"\n" not in got:
        piece = await loop.sock_recv(accepted.conn, FIRST_LINE_LIMIT - len(got))
        if not piece:
            return b"", b""
        accepted.heard = True       # a peer at its line: closed to make room only where every one waiting is
        got += piece
        if len(got) >= FIRST_LINE_LIMIT and b"\n" not in got:
            return b"", b""
    line, _, rest = got.partition(b"\n")
    return line + b"\n", rest


async def _hello(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> bool:
    """Whether the peer's first bytes (its ClientHello) came, not its close. Only then does a handshake start: each
    holds ~1 MiB of buffers. A review: strangers connecting and closing at once, 2,400 a second, each started one
    (RSS 24 -> 231 MiB, a peer's copy up to 3.9 s late); silent ones now cost a descriptor until HANDSHAKE_S."""
    ready: asyncio.Future[None] = loop.create_future()
    loop.add_reader(conn.fileno(), lambda: None if ready.done() else ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(conn.fileno())
    try:
        return bool(conn.recv(1, socket.MSG_PEEK))
    except OSError:
        return False


async def _close(writer: asyncio.StreamWriter) -> None:
    """Close a served connection within CLOSE_S, else abort it: a TLS close waits for the peer's close_notify (30 s
    by default) and a plain one for the peer to read what is still buffered (forever), each holding a descriptor and,
    over TLS, a 256 KiB buffer. A review: a peer with a member's certificate that sent a line and never answered the
    close held 1,700 connections past the cap of 512, 600 MB, and the agent out of descriptors."""
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), CLOSE_S)
    except (OSError, asyncio.TimeoutError):
        pass
    finally:        # closed already: nothing; else at once, and on a cancel too (the listener closing)
        writer.transport.abort()


def _let_go(conn: socket.socket, transport: asyncio.WriteTransport | None,
            connected: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]], owned: bool) -> None:
    """End a connection at once, whatever stage it was cut at. A socket asyncio made a transport on is never closed
    here: a wait cancelled just as the TLS handshake ended (closed for room) leaves that transport shutting TLS down,
    reading the socket's number for up to 30 s, and the number closed under it goes to the next socket (a review: "File
    descriptor N is used by transport", a traceback, and a peer's push lost). Its stream, where the handshake made one,
    is aborted; else the socket is shut down, so the transport fails on it and closes it itself."""
    if transport is None and connected.done() and not connected.cancelled():
        transport = connected.result()[1].transport
    if transport is not None:
        transport.abort()
    if owned:
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
    else:
        conn.close()


class Listener:
    def __init__(self, handler: Handler, caps: Caps, say: Callable[[str], None], tls: ssl.SSLContext | None = None,
                 name: str = "listener") -> None:
        self.handler, self.caps, self.tls, self.name = handler, caps, tls, name
        self._say = SayOnce(say)
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._serving: set[asyncio.Task[None]] = set()
        self._handshaking: dict[Accepted, None] = {}     # TLS handshakes under way, the longest first
        self._peers: OrderedDict[str, None] = OrderedDict()   # sources a handshake was done from, the latest last

    async def start(self, addr: str) -> int:
        """Listen on a free port of `addr`; the port, or 0 when that is not possible."""
        try:
            family = socket.AF_INET6 if ":" in addr else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                keepalive.enable(sock)     # what it accepts inherits it: a copy's peer gone is noticed in ~4 s
                sock.bind((addr, 0))
                sock.listen(socket.SOMAXCONN)
                sock.setblocking(False)
            except OSError:
                sock.close()
                raise
        except OSError:
            return 0
        self._sock = sock
        self._accepting = asyncio.create_task(accept(sock, self.caps, self.name, self._say, self._serve, self._serving))
        return int(sock.getsockname()[1])

    async def _connect(self, loop: asyncio.AbstractEventLoop, made: Callable[[], asyncio.StreamReaderProtocol],
                       accepted: Accepted, limit_s: float = HANDSHAKE_S
                       ) -> tuple[asyncio.Transport, asyncio.BaseProtocol]:
        """The accepted socket as a stream's transport, over TLS once its handshake is done. A handshake holds ~1 MiB
        of buffers while it lasts (a review's flood of strangers' handshakes took the agent from 49 to 550 MiB), so
        at most a quarter of the total cap go on at once: past that one under way is ended (`_gives_way`). A peer's
        takes milliseconds; a newcomer never waits behind a stranger's (the server's TLS port does alike)."""
        if self.tls is None:
            return await loop.connect_accepted_socket(made, accepted.conn)
        while len(self._handshaking) >= max(2, self.caps.total // HANDSHAKES_SHARE):
            if (longest := self._gives_way(accepted.source)) is None:
                raise OSError("a stranger's handshake among peers' only: closed")
            del self._handshaking[longest]
            self.caps.at_work(longest.source, longest)      # out of the waiting ones first: evicted once
            longest.evict()
        self._handshaking[accepted] = None
        try:
            made_ = await loop.connect_accepted_socket(made, accepted.conn, ssl=self.tls,
                                                       ssl_handshake_timeout=limit_s)
        finally:
            self._handshaking.pop(accepted, None)
        self._peers[accepted.source] = None     # the copy port requires a certificate the CA signed: a member's
        self._peers.move_to_end(accepted.source)
        if len(self._peers) > KNOWN_PEERS:
            self._peers.popitem(last=False)
        return made_

    def _gives_way(self, newcomer: str) -> Accepted | None:
        """The handshake ended for a newcomer's: a stranger's (a source no handshake was ever done from) before a
        peer's, of the source with the most under way, its longest. A newcomer that is a stranger itself ends no
        peer's (None: it is closed). A review: ClientHellos then silence, 300 at once from 10 addresses, ended a
        third of a peer's handshakes as the longest under way (its copy refused, tried again RETRY_S later)."""
        under_way = list(self._handshaking)
        pool = [a for a in under_way if a.source not in self._peers]
        if not pool and newcomer not in self._peers:
            return None
        counts = Counter(a.source for a in pool or under_way)
        most = max(counts.values())
        return next(a for a in pool or under_way if counts[a.source] == most)

    async def _serve(self, accepted: Accepted) -> None:
        """In the clear the first line is read off the socket itself, a piece of at most FIRST_LINE_LIMIT at a time
        (a stream's transport would read 256 KiB at once); over TLS, after the handshake, into a small buffer."""
        loop = asyncio.get_running_loop()
        connected: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = loop.create_future()
        line, rest = b"", b""
        conn, source = accepted.conn, accepted.source
        accepted.started = True
        transport: asyncio.Transport | None = None      # once made, it owns the socket
        owned = False       # asyncio made a transport on the socket (before handing it over): it closes the socket

        def made() -> asyncio.StreamReaderProtocol:
            nonlocal owned
            owned = True
            reader = asyncio.StreamReader(limit=FIRST_LINE_LIMIT)
            reader.feed_data(rest)         # what came after the first line, before the stream took over
            return asyncio.StreamReaderProtocol(reader, lambda r, w: connected.set_result((r, w)))

        try:
            try:
                began = loop.time()
                if self.tls is None:
                    line, rest = await asyncio.wait_for(_first_line(loop, accepted), FIRST_LINE_S)
                    if not line:
                        conn.close()
                        return
                elif not await asyncio.wait_for(_hello(loop, conn), HANDSHAKE_S):
                    conn.close()
                    return
                accepted.heard = accepted.sent()      # its hello in: the handshake reads it off the socket
                left = max(0.5, HANDSHAKE_S - (loop.time() - began))
                transport, _ = await asyncio.wait_for(self._connect(loop, made, accepted, left), left + 1)
                reader, writer = await asyncio.wait_for(connected, 1.0)
            except (OSError, ValueError, asyncio.TimeoutError):     # a handshake refused or too slow: said nowhere
                _let_go(conn, transport, connected, owned)
                return
            try:
                with contextlib.suppress(OSError, ValueError, asyncio.TimeoutError):
                    if not line:
                        line = await asyncio.wait_for(reader.readline(), FIRST_LINE_S)
                    if line and not accepted.evicted:        # (a cancel a finished read swallowed)
                        self.caps.at_work(source, accepted)  # never closed to make room from now on
                        await self.handler(line, reader, writer)
            finally:
                await _close(writer)
        except asyncio.CancelledError:
            # Closed at once and unregistered from the loop: the socket's number may be reused by the next accept
            # right after (a TLS close would wait for the peer's close_notify with the number still registered).
            _let_go(conn, transport, connected, owned)
            if not accepted.evicted:
                raise                                        # the listener closing: evicted ones just end
        finally:
            self.caps.at_work(source, accepted)
            if not accepted.evicted:
                self.caps.give(source)

    async def close(self) -> None:
        tasks = [t for t in (self._accepting, *self._serving) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
