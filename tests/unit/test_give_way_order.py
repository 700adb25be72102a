"""Which held poll gives way at the connection limit (delivery/give_way.py): the tiers in order, a draw within one,
and a poll that waits again keeps its one place; the guard closes a newcomer whose request is unread last."""
from __future__ import annotations

import socket
import time

from rdzv_server.delivery.give_way import EXTRA, MEMBER, OUTSIDE, WaitingOrder, tier
from rdzv_server.web.connections import GIVE_WAY_SLACK, ConnectionGuard
from tests.unit.test_rendezvous import cfg, job, running


class Sub:
    """A stand-in subscriber: WaitingOrder only hashes it."""


def test_tiers_go_in_order_and_a_draw_picks_within_one():
    draws: list[int] = []

    def draw(n: int) -> int:
        draws.append(n)
        return n - 1                     # the last of the tier
    order = WaitingOrder(draw)
    m1, m2, w1, extra = Sub(), Sub(), Sub(), Sub()
    for sub, t in ((m1, MEMBER), (m2, MEMBER), (w1, OUTSIDE), (extra, EXTRA)):
        order.add(sub, t)
    order.add(m1, MEMBER)                # waiting again: still one place
    assert order.first_to_give_way() is extra and draws == [1]
    order.discard(extra)
    assert order.first_to_give_way() is w1
    order.discard(w1)
    assert order.first_to_give_way() is m2 and draws[-1] == 2
    order.discard(m1)                    # the last one takes the removed one's slot
    assert order.first_to_give_way() is m2 and draws[-1] == 1
    order.add(m2, OUTSIDE)               # its node left the round: moves tier
    order.discard(m2)
    assert order.first_to_give_way() is None


def test_a_poll_s_tier_comes_from_its_node_and_its_job():
    rz = running(["a", "b"], cfg(min_nodes=2, max_nodes=2))
    assert tier(job(rz), "a", 1) == MEMBER and tier(job(rz), "a", 2) == EXTRA
    assert tier(job(rz), "stranger", 1) == OUTSIDE and tier(None, "a", 1) == OUTSIDE


class Handler:
    def __init__(self, sock: socket.socket) -> None:
        self.transport = Transport(sock)


class Transport:
    def __init__(self, sock: socket.socket, tls: bool = False) -> None:
        self.sock, self.tls, self.closed, self.aborted = sock, tls, False, False

    def get_extra_info(self, name: str) -> object:
        return {"socket": self.sock, "sslcontext": object() if self.tls else None}.get(name)

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True


def test_room_is_made_from_an_idle_connection_before_a_newcomer_whose_request_is_unread():
    guard = ConnectionGuard(4)
    pairs = [socket.socketpair() for _ in range(3)]
    try:
        older, arriving, idle = (Handler(server) for server, _ in pairs)
        pairs[1][1].sendall(b"POST /v1/jobs/j/poll HTTP/1.1\r\n")     # the newcomer's request, not yet read
        now = time.monotonic()
        guard._unproven.update({older: now - 5.0, arriving: now, idle: now})
        pairs[0][1].sendall(b"x")        # an old one, a few bytes unread for 5 s: idle
        assert guard._make_room() and older.transport.closed          # the oldest unproven first
        assert guard._make_room() and idle.transport.closed and not arriving.transport.closed
        assert guard._make_room() and arriving.transport.closed       # the last to go, before any held poll
    finally:
        for a, b in pairs:
            a.close()
            b.close()



class FakeServer:
    """aiohttp's Server as the guard wraps it: makes handlers, told of their connections."""

    def __init__(self, socks: list[socket.socket]) -> None:
        self.socks = socks

    def __call__(self) -> Handler:
        return Handler(self.socks.pop())

    def connection_made(self, handler: Handler, transport: Transport) -> None:
        pass

    def connection_lost(self, handler: Handler, exc: BaseException | None = None) -> None:
        pass


async def test_a_tls_newcomer_at_the_limit_starts_its_handshake_and_room_is_made_once_it_is_done():
    """The TLS port asks as a handshake starts (evict=False): nothing is closed for a handshake that may never end;
    once it is done an idle connection is closed for it, else a held poll gives way, else it goes itself."""
    pairs = [socket.socketpair() for _ in range(5)]
    try:
        server = FakeServer([a for a, _ in pairs])
        guard = ConnectionGuard(2)
        asked: list[bool] = []
        guard.give_way = lambda: asked.append(len(asked) == 0) or asked[-1]     # a held poll gives way once
        make = guard.factory(server, evict=False)       # type: ignore[arg-type]

        def connect(handler: object) -> Handler:
            assert isinstance(handler, Handler), "refused as its handshake starts"
            server.connection_made(handler, handler.transport)
            return handler
        busy, idle = connect(make()), connect(make())
        guard._busy[busy] = object()                    # a held poll
        newcomer = make()                               # at the limit: its handshake starts, nothing closed yet
        assert isinstance(newcomer, Handler) and not idle.transport.closed
        connect(newcomer)                               # done: the idle one goes for it
        assert idle.transport.closed and not newcomer.transport.closed and newcomer in guard._unproven
        server.connection_lost(idle)
        guard._busy[newcomer] = object()
        second = connect(make())                        # none idle: a held poll gives way
        assert asked == [True] and not second.transport.closed
        guard._busy[second] = object()
        third = connect(make())                         # none idle, no poll gives way: it goes itself
        assert asked == [True, False] and third.transport.closed and guard.refused == 1
    finally:
        for a, b in pairs:
            a.close()
            b.close()


async def test_handshakes_past_the_limit_are_bounded_by_closing_the_longest_waiting():
    a, b = socket.socketpair()
    try:
        guard = ConnectionGuard(2)
        make = guard.factory(FakeServer([a]), evict=False)      # type: ignore[arg-type]
        guard._fresh.update({object(): time.monotonic() for _ in range(2 + GIVE_WAY_SLACK)})
        closed: list[bool] = []
        guard.close_a_handshake = lambda: closed.append(False) or False      # none in progress to close
        assert not isinstance(make(), Handler) and closed == [False] and guard.refused == 1
        guard.close_a_handshake = lambda: closed.append(True) or True        # the longest waiting closed for it
        assert isinstance(make(), Handler) and closed == [False, True]
    finally:
        a.close()
        b.close()


def test_a_tls_connection_waiting_for_its_peers_close_notify_is_ended_to_make_room():
    """A TLS connection the server closed waits up to SHUTDOWN_S for its peer's close_notify, counted all along: a
    stranger asking with `Connection: close` and never answering filled the limit with them (a review: members'
    polls gave way to its newcomers, nodes lost). It is aborted to make room, once; a plain one is gone in a turn."""
    pairs = [socket.socketpair() for _ in range(3)]
    try:
        guard = ConnectionGuard(4)
        closing_tls, closing_plain, idle = (Handler(a) for a, _ in pairs)
        closing_tls.transport.tls = True
        closing_tls.transport.closed = closing_plain.transport.closed = True
        now = time.monotonic()
        guard._unproven.update({closing_plain: now - 3.0, closing_tls: now - 2.0, idle: now - 1.0})
        assert guard._make_room() and closing_tls.transport.aborted and not idle.transport.closed
        assert guard._make_room() and idle.transport.closed and not closing_plain.transport.aborted
        assert not guard._make_room() and guard.evicted == 2       # each closed once, until its end is told
    finally:
        for a, b in pairs:
            a.close()
            b.close()
