"""The server's TLS port accepts its connections itself (protocol/accepting.py), so a handshake is bounded before it
costs more than a descriptor. asyncio's own listener holds a silent connection through a 60 s handshake, and one
refused at the cap until its handshake ends: a stranger opening connections that never say hello (no token needed)
held every descriptor, and an agent whose connection broke could not reconnect. Here:
- a handshake is done within HANDSHAKE_S, or its connection is closed; a closing one waits SHUTDOWN_S at most;
- at most `handshakes` are in progress at once (a quarter of the connection cap), however many from one address; at
  that cap the oldest handshake of the address with the most in progress is closed for the newcomer (a flood's,
  not an agent's; IPv6 addresses counted by /64): no connected one is closed for it. At the connection limit a
  handshake goes on, and an idle connection is closed for it once it is done (web/connections.py);
- out of descriptors while accepting: said once a minute, accepting again after a pause.
Once its handshake is done a connection is aiohttp's, within the ConnectionGuard's cap (web/connections.py)."""
from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import sys
from collections.abc import Callable

from protocol.accepting import Accepted, Caps, SayOnce, accept

log = logging.getLogger("rdzv_server")

HANDSHAKE_S = 5.0
SHUTDOWN_S = 2.0          # a closed connection's close_notify: a peer that never answers holds its descriptor no longer
_SHUTDOWN = {"ssl_shutdown_timeout": SHUTDOWN_S} if sys.version_info >= (3, 11) else {}


class TlsPort:
    def __init__(self, sock: socket.socket, factory: Callable[[], asyncio.BaseProtocol], tls: ssl.SSLContext,
                 handshakes: int, not_connected: Callable[[asyncio.BaseProtocol], None]) -> None:
        """`factory`: the connections' protocols (the ConnectionGuard's); `not_connected(protocol)`: a protocol
        made whose handshake failed (the guard stops counting it at once)."""
        self.sock, self.factory, self.tls, self.not_connected = sock, factory, tls, not_connected
        self.caps = Caps(total=handshakes, per_source=handshakes)
        self._serving: set[asyncio.Task[None]] = set()
        self._asking: Accepted | None = None       # the handshake whose protocol is being made
        self._accepting = asyncio.create_task(accept(sock, self.caps, "the TLS port", SayOnce(log.warning),
                                                     self._handshake, self._serving))

    async def _handshake(self, accepted: Accepted) -> None:
        accepted.started = True
        made: list[asyncio.BaseProtocol] = []

        def protocol() -> asyncio.BaseProtocol:
            self._asking = accepted          # spared by close_a_handshake: the room is for it
            try:
                made.append(self.factory())
            finally:
                self._asking = None
            return made[-1]

        connected = False
        try:
            await asyncio.wait_for(asyncio.get_running_loop().connect_accepted_socket(
                protocol, accepted.conn, ssl=self.tls, ssl_handshake_timeout=HANDSHAKE_S, **_SHUTDOWN),
                HANDSHAKE_S + 1)
            connected = True
        except (OSError, ValueError, asyncio.TimeoutError):      # refused or too slow: said nowhere
            pass
        finally:
            if not connected:           # refused, too slow, or closed to make room
                if not made:
                    accepted.conn.close()       # no transport yet (one made closes itself, and its socket)
                for p in made:
                    self.not_connected(p)
            self.caps.at_work(accepted.source, accepted)
            if not accepted.evicted:
                self.caps.give(accepted.source)

    def close_a_handshake(self) -> bool:
        """Close the handshake waiting longest that has sent nothing, else the longest waiting (Caps), for a newcomer
        at the connection limit; False where none is in progress."""
        return self.caps.close_one_waiting(sparing=self._asking)

    def close(self) -> None:
        """No new connections (those connected are aiohttp's to close)."""
        for task in (self._accepting, *self._serving):
            task.cancel()
        self.sock.close()
