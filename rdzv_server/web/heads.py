"""Request heads in flight: what a connection sent since its last head was whole (its body apart), which aiohttp keeps
parsed until the head ends, up to 128 fields of 8 KiB (~1 MiB a head, ~1.6 MiB of memory). A review: strangers'
connections (no token needed) each holding an unfinished head took the server's RSS 47 -> 988 MiB at 600 of them;
aiohttp set no deadline for a first request, and the connection cap (~19,700) was 30 GB away. Kept by the guard:
- a connection's first head begins within HEAD_TIMEOUT_S of its connect, and any head ends within HEAD_TIMEOUT_S of its
  first byte, or the connection is closed;
- all heads in flight together hold at most HEAD_BYTES: past it the oldest are closed first. A legitimate head (an
  agent's, a browser's, a scrape's: a few KiB at most) arrives whole, in a packet or a few, long before a held one.
Not per source: many agents can share one NAT address. Never one with a request in progress (a held long-poll).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp.web_protocol import RequestHandler

from protocol.accepting import SayOnce

log = logging.getLogger("rdzv_server")

HEAD_TIMEOUT_S = 20.0
HEAD_BYTES = 16 << 20
# Bytes are handed to aiohttp at most this many at a time, so a head's end is seen to within a piece: what follows it
# in the same piece (a pipelined next head) is not counted, at most this much a connection (~5 KiB is its own cost).
PIECE = 2048
LATE_CHECK_S = 1.0        # a head past its deadline behind a request in progress is looked at again this often
# aiohttp's private fields the counter reads: where they are missing (another aiohttp) heads go unbounded, said once.
FIELDS = ("_request_count", "_messages")
OFF = ("request heads are not bounded in time or bytes: this aiohttp's RequestHandler lacks %s (web/heads.py reads "
       "them); unfinished heads are held as long as aiohttp holds them")


class Heads:
    """The heads in flight of the connections made by `wrap`, bounded in time and in bytes. `busy(handler)`: whether
    a request is in progress on it (never closed)."""

    def __init__(self, busy: Callable[[Any], bool], timeout_s: float = HEAD_TIMEOUT_S,
                 budget: int = HEAD_BYTES) -> None:
        self.busy, self.timeout_s, self.budget = busy, timeout_s, budget
        self.total = 0                                  # bytes of the heads in flight
        self.closed = 0
        self._silent: dict[_Counted, list[float]] = {}  # connected, nothing sent yet: [when, 0] (oldest first)
        self._flight: dict[_Counted, list[float]] = {}  # a head begun: [when, bytes] (oldest first)
        self._timer: asyncio.TimerHandle | None = None
        self._say = SayOnce(log.warning)
        # Said at start where the class lacks them; handlers lacking them all the same are said at the first one.
        missing = [field for field in FIELDS if not hasattr(RequestHandler, field)]
        self.off = bool(missing)
        if missing:
            log.warning(OFF, " and ".join(missing))

    def wrap(self, handler: Any) -> asyncio.BaseProtocol:
        """`handler` (aiohttp's RequestHandler) fed through a counter; as it is where aiohttp's fields differ (said
        once, the tests/integration/test_unfinished_heads.py then fail)."""
        if self.off:
            return handler      # type: ignore[no-any-return]
        if not (isinstance(getattr(handler, FIELDS[0], None), int) and hasattr(handler, FIELDS[1])):
            self.off = True
            log.warning(OFF, "an int " + " and ".join(FIELDS))
            return handler      # type: ignore[no-any-return]
        return _Counted(handler, self)

    def connected(self, counted: _Counted) -> None:
        self._silent[counted] = [time.monotonic(), 0]
        self._arm()

    def received(self, counted: _Counted, data: bytes) -> None:
        """Feed `data` to the handler piece by piece, counting the pieces that are part of a head."""
        handler = counted.handler
        if self._silent:
            self._silent.pop(counted, None)
        for start in range(0, len(data), PIECE) if len(data) > PIECE else (0,):
            if handler.transport is None or handler.transport.is_closing():
                return                              # closed (by `_close` too): aiohttp reads no more of it
            piece = data[start:start + PIECE] if len(data) > PIECE else data
            if counted.body is not None and counted.body.is_eof():
                counted.body = None                 # the last head's body is in: what comes next begins a head
            in_body = counted.body is not None
            handler.data_received(piece)
            if counted.ended():                     # a head ended in this piece: what follows is a body or a head
                counted.seen = handler._request_count
                counted.body = handler._messages[-1][1] if handler._messages else None
                self.forget(counted)
            elif not in_body:
                self._add(counted, len(piece))

    def forget(self, counted: _Counted) -> None:
        self._silent.pop(counted, None)
        entry = self._flight.pop(counted, None)
        if entry is not None:
            self.total -= int(entry[1])

    def _add(self, counted: _Counted, size: int) -> None:
        entry = self._flight.get(counted)
        if entry is None:
            entry = self._flight[counted] = [time.monotonic(), 0]
            self._arm()
        entry[1] += size
        self.total += size
        while self.total > self.budget:      # the oldest first (those behind a request in progress spared)
            oldest = next((c for c in self._flight if not self.busy(c.handler)), None)
            if oldest is None:
                return
            self._close(oldest, f"request heads in flight held over {self.budget >> 20} MiB together", "bytes")

    def _arm(self) -> None:
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.timeout_s, self._sweep)

    def _sweep(self) -> None:
        """Close the connections past their deadlines; look again at the next one's."""
        self._timer = None
        now = time.monotonic()
        ends = now + self.timeout_s
        for waiting in (self._silent, self._flight):
            for counted, (began, _) in list(waiting.items()):
                if now - began < self.timeout_s:
                    ends = min(ends, began + self.timeout_s)
                    break
                if waiting is self._flight and self.busy(counted.handler):
                    ends = min(ends, now + LATE_CHECK_S)
                    continue
                self._close(counted, f"no whole request head within {self.timeout_s:g}s", "slow")
        if self._silent or self._flight:
            self._timer = asyncio.get_running_loop().call_later(max(ends - now, 0.0), self._sweep)

    def _close(self, counted: _Counted, why: str, kind: str) -> None:
        self.forget(counted)
        transport = counted.handler.transport
        if counted.ended() or transport is None:
            return              # whole after all (aiohttp parsed a pipelined head it had paused on its own), or gone
        self.closed += 1
        transport.abort()       # its descriptor and what it held freed at once
        peer = transport.get_extra_info("peername")
        self._say(f"closed a connection from {peer[0] if peer else 'an unknown address'}: {why} ({self.closed} closed "
                  "so far; a client sending requests it never finishes?)", kind)


class _Counted(asyncio.Protocol):
    """aiohttp's RequestHandler, its bytes counted on their way in (`Heads.received`)."""

    def __init__(self, handler: Any, heads: Heads) -> None:
        self.handler, self.heads = handler, heads
        self.seen = 0                        # the handler's heads that ended (its _request_count)
        self.body: Any = None                # the last head's body while it is not all in

    def ended(self) -> bool:
        """Whether the handler has parsed a head since `seen` was taken."""
        return bool(self.handler._request_count != self.seen)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.handler.connection_made(transport)
        self.heads.connected(self)

    def data_received(self, data: bytes) -> None:
        self.heads.received(self, data)

    def eof_received(self) -> bool | None:
        return self.handler.eof_received()          # type: ignore[no-any-return]

    def connection_lost(self, exc: Exception | None) -> None:
        self.heads.forget(self)
        self.handler.connection_lost(exc)

    def pause_writing(self) -> None:
        self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.handler.resume_writing()


def unwrapped(protocol: Any) -> Any:
    """The handler of a protocol `Heads.wrap` made (the protocol itself where it made none)."""
    return protocol.handler if isinstance(protocol, _Counted) else protocol
