"""A listener that faces strangers: the agent's witness port (peer copies in the clear come there too) and its TLS
port for peer copies. Anyone who can reach the node can connect, so each connection is bounded before it costs
more than a descriptor, as the server bounds its own:
- at most `Caps.total` connections open for all of the agent's listeners together, and `Caps.per_source` from one
  address: past the per-source cap a new connection is closed at once, before any TLS handshake (the accept loop
  is ours for that reason); at the total cap a connection still waiting for its first line is closed to make
  room, the oldest of the source with the most waiting (a flood's, not a peer's one: idle connections cannot shut
  out a witness's question or a copy; one at work is never closed), and only when none waits is the new one closed;
  either is said, once a minute;
- a TLS handshake done within HANDSHAKE_S, then the first line within FIRST_LINE_S (4 s each), read into a buffer of
  FIRST_LINE_LIMIT bytes (a real first line is under 512); what breaks either is closed without a word;
- out of descriptors while accepting (EMFILE): said, once a minute, and accepting goes on after a pause.
The handler gets the first line and the connection; it may widen the reader's buffer for a payload
(node_agent.copies.stream.widen); the connection is closed when it returns."""
from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
import ssl
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from protocol import keepalive

MAX_CONNECTIONS = 512     # open at once, for all the agent's listeners (and a quarter of its descriptors at most)
MAX_PER_SOURCE = 64       # open at once from one address (a node pushes, fetches and asks with a few each)
HANDSHAKE_S = 4.0       # within the 5 s an operator is promised, with a margin for a loaded machine
FIRST_LINE_S = 4.0
FIRST_LINE_LIMIT = 1024   # the reader's buffer until the first line is in: a longer line ends the connection
ACCEPT_PAUSE_S = 0.5      # out of descriptors: accepting waits this long before it tries again
SAY_EVERY_S = 60.0
TAKEN, EVICTED, REFUSED = "taken", "evicted", "refused"     # Caps.take

Handler = Callable[[bytes, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Caps:
    """Connections open now, in total and by source address, for every listener of one agent, and those still
    waiting for their first line (the ones closed to make room at the total cap)."""

    def __init__(self, total: int = MAX_CONNECTIONS, per_source: int = MAX_PER_SOURCE) -> None:
        self.total, self.per_source = total, per_source
        self.open: dict[str, int] = {}      # source address -> its connections open now
        self.count = 0                      # all of them (every accept in a flood asks: kept, not summed)
        # source address -> its connections waiting for their first line, oldest first: what closes each
        self.waiting: dict[str, OrderedDict[object, Callable[[], None]]] = {}

    @classmethod
    def for_descriptors(cls, limit: int) -> Caps:
        """Caps that leave three quarters of `limit` descriptors to the rest of the agent (workers, pipes, polls)."""
        return cls(total=max(16, min(MAX_CONNECTIONS, limit // 4)))

    def take(self, source: str) -> str:
        """TAKEN: `source` may open one more; EVICTED: so, once a connection waiting for its first line was closed
        to make room, the oldest of the source with the most waiting (`close()` gives its count back at once);
        REFUSED: at the per-source cap, or at the total cap with every connection at work."""
        if self.open.get(source, 0) >= self.per_source:
            return REFUSED
        taken = TAKEN
        if self.count >= self.total:
            if not self.waiting:
                return REFUSED
            most = max(self.waiting, key=lambda s: len(self.waiting[s]))   # ties: the source waiting longest
            _, close = self.waiting[most].popitem(last=False)
            if not self.waiting[most]:
                del self.waiting[most]
            close()
            taken = EVICTED
        self.open[source] = self.open.get(source, 0) + 1
        self.count += 1
        return taken

    def wait(self, source: str, key: object, close: Callable[[], None]) -> None:
        """A connection of `source` waits for its first line: `close()` ends it to make room."""
        self.waiting.setdefault(source, OrderedDict())[key] = close

    def at_work(self, source: str, key: object) -> None:
        """The connection's first line is in (or it ended): it is no longer closed to make room."""
        mine = self.waiting.get(source)
        if mine is not None and mine.pop(key, None) is not None and not mine:
            del self.waiting[source]

    def give(self, source: str) -> None:
        self.count -= 1
        left = self.open.get(source, 0) - 1
        if left > 0:
            self.open[source] = left
        else:
            self.open.pop(source, None)


class _Accepted:
    """A connection accepted, served by `task`: `evict()` ends it to make room (Caps.take), its count given back at
    once; a task that has not started yet never will, so its socket is closed here."""

    def __init__(self, conn: socket.socket, source: str, caps: Caps) -> None:
        self.conn, self.source, self.caps = conn, source, caps
        self.task: asyncio.Task[None] | None = None
        self.started = self.evicted = False

    def evict(self) -> None:
        self.evicted = True
        self.caps.give(self.source)
        if self.task is not None:
            self.task.cancel()
        if not self.started:
            self.conn.close()


async def _first_line(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> tuple[bytes, bytes]:
    """(the first line with its newline, what came after it), or (b"", b"") when the peer closed or sent a line
    longer than FIRST_LINE_LIMIT."""
    got = b""
    while b"\n" not in got:
        piece = await loop.sock_recv(conn, FIRST_LINE_LIMIT - len(got))
        if not piece:
            return b"", b""
        got += piece
        if len(got) >= FIRST_LINE_LIMIT and b"\n" not in got:
            return b"", b""
    line, _, rest = got.partition(b"\n")
    return line + b"\n", rest


class Listener:
    def __init__(self, handler: Handler, caps: Caps, say: Callable[[str], None], tls: ssl.SSLContext | None = None,
                 name: str = "listener") -> None:
        self.handler, self.caps, self.tls, self.name = handler, caps, tls, name
        self._say = say
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._serving: set[asyncio.Task[None]] = set()
        self._said_at = -SAY_EVERY_S

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
        self._accepting = asyncio.create_task(self._accept(sock))
        return int(sock.getsockname()[1])

    async def _accept(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, peer = await loop.sock_accept(sock)
            except OSError as exc:
                if sock.fileno() < 0:
                    return                              # closed
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._say_now(f"{self.name}: out of descriptors or memory accepting a connection "
                                  f"({exc.strerror}): connections wait in the backlog; accepting again in "
                                  f"{ACCEPT_PAUSE_S:g}s")
                await asyncio.sleep(ACCEPT_PAUSE_S if exc.errno != errno.ECONNABORTED else 0)   # a pause, not a wait
                continue
            source = str(peer[0]) if isinstance(peer, tuple) else "?"
            taken = self.caps.take(source)
            if taken != TAKEN:
                done = "closed an idle one (of the source with the most) for" if taken == EVICTED else "refused"
                self._say_now(f"{self.name}: at its cap of {self.caps.total} connections ({self.caps.per_source} "
                              f"from one address): {done} a connection from {source!r} (said once a minute)")
            if taken == REFUSED:
                conn.close()                             # at once: no handshake, no buffer, no task
                continue
            accepted = _Accepted(conn, source, self.caps)
            accepted.task = asyncio.create_task(self._serve(accepted))
            self.caps.wait(source, accepted, accepted.evict)     # from now: a burst finds it waiting, too
            self._serving.add(accepted.task)
            accepted.task.add_done_callback(self._serving.discard)

    async def _serve(self, accepted: _Accepted) -> None:
        """In the clear the first line is read off the socket itself, a piece of at most FIRST_LINE_LIMIT at a time
        (a stream's transport would read 256 KiB at once); over TLS, after the handshake, into a small buffer."""
        loop = asyncio.get_running_loop()
        connected: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = loop.create_future()
        line, rest = b"", b""
        conn, source = accepted.conn, accepted.source
        accepted.started = True
        transport: asyncio.Transport | None = None      # once made, it owns the socket

        def made() -> asyncio.StreamReaderProtocol:
            reader = asyncio.StreamReader(limit=FIRST_LINE_LIMIT)
            reader.feed_data(rest)         # what came after the first line, before the stream took over
            return asyncio.StreamReaderProtocol(reader, lambda r, w: connected.set_result((r, w)))

        try:
            try:
                if self.tls is None:
                    line, rest = await asyncio.wait_for(_first_line(loop, conn), FIRST_LINE_S)
                    if not line:
                        conn.close()
                        return
                transport, _ = await asyncio.wait_for(
                    loop.connect_accepted_socket(made, conn, ssl=self.tls,
                                                 ssl_handshake_timeout=HANDSHAKE_S if self.tls else None),
                    HANDSHAKE_S + 1)
                reader, writer = await asyncio.wait_for(connected, 1.0)
            except (OSError, ValueError, asyncio.TimeoutError):     # a handshake refused or too slow: said nowhere
                conn.close()
                return
            try:
                with contextlib.suppress(OSError, ValueError, asyncio.TimeoutError):
                    if not line:
                        line = await asyncio.wait_for(reader.readline(), FIRST_LINE_S)
                    if line and not accepted.evicted:        # (a cancel a finished read swallowed)
                        self.caps.at_work(source, accepted)  # never closed to make room from now on
                        await self.handler(line, reader, writer)
            finally:
                writer.close()
        except asyncio.CancelledError:
            # Closed at once and unregistered from the loop: the socket's number may be reused by the next accept
            # right after (a TLS close would wait for the peer's close_notify with the number still registered).
            if transport is not None:
                transport.abort()
            else:
                conn.close()
            if not accepted.evicted:
                raise                                        # the listener closing: evicted ones just end
        finally:
            self.caps.at_work(source, accepted)
            if not accepted.evicted:
                self.caps.give(source)

    def _say_now(self, line: str) -> None:
        now = time.monotonic()
        if now - self._said_at >= SAY_EVERY_S:
            self._said_at = now
            self._say(line)

    async def close(self) -> None:
        tasks = [t for t in (self._accepting, *self._serving) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
