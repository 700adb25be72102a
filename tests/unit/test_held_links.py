"""Held polls' connections as signs of life (rdzv_server/delivery/links.py): in a 2-node job whose other
node's poll is held, the server hears no request for the whole hold, but that connection's kernel
answers keepalive probes; a dead node is then lost, not spared by the rules about silences."""
from __future__ import annotations

from protocol.messages import PollRequest
from rdzv_server.core.events import EventKind
from rdzv_server.core.requests import Arrival
from rdzv_server.delivery.links import CHECK_GAP_S, HeldLinks
from tests.unit.test_leases import LEASE, job_with


def run_until_lost(rz, links: HeldLinks | None, start: float, end: float) -> float | None:
    """Tick at every deadline (the coordinator's loop, links asked first); when b was lost, or None."""
    t = start
    while t < end:
        if links is not None:
            links.check(rz, t)
        rz.tick(t)
        if "b" not in rz.jobs["j"].nodes:
            return t
        t = max(rz.next_deadline() or end, t + 0.05)
    return None


def test_a_silent_dead_node_is_lost_while_the_other_nodes_poll_is_held_and_its_link_answers():
    rz = job_with("a", "b")                       # b joined at 0 and never speaks again: dead
    rz.handle("j", PollRequest(v=1, node_id="a"), 0.5, Arrival(hold=True))     # held from here on: no request heard
    links = HeldLinks()
    links.add(lambda: 0.3)                        # a's connection answered a keepalive probe 0.3 s ago
    lost_at = run_until_lost(rz, links, LEASE, 60.0)
    assert lost_at is not None and lost_at <= LEASE + 2.0
    assert EventKind.LEASES_EXTENDED not in [e.kind for e in rz.jobs["j"].events]


def test_without_the_links_answer_the_same_silence_is_taken_for_the_servers_own():
    rz = job_with("a", "b")
    rz.handle("j", PollRequest(v=1, node_id="a"), 0.5, Arrival(hold=True))
    links = HeldLinks()
    links.add(lambda: None)                       # unknown (no TCP_INFO): no evidence either way
    links.add(lambda: 30.0)                       # and a connection silent since before: the link may be down
    assert run_until_lost(rz, links, LEASE, 30.0) is None
    assert EventKind.LEASES_EXTENDED in [e.kind for e in rz.jobs["j"].events]


def test_the_connections_are_asked_at_most_every_check_gap_and_only_once_the_server_heard_nobody():
    rz = job_with("a", "b")
    asked = []
    links = HeldLinks()
    links.add(lambda: asked.append(1) or 0.2)
    rz.handle("j", PollRequest(v=1, node_id="a"), 1.0, Arrival(hold=True))
    links.check(rz, 1.5)                          # heard 0.5 s ago: nothing to ask
    assert asked == []
    links.check(rz, 3.0)
    links.check(rz, 3.0 + CHECK_GAP_S / 2)        # asked just now (and heard 2.8): not again
    assert asked == [1] and rz.heard_at == 3.0 - 0.2
    links.check(rz, 3.0 + CHECK_GAP_S + 2.0)
    assert asked == [1, 1]



def test_a_connection_ended_by_its_peers_host_is_told_from_one_a_silent_path_ended():
    """What a closed TLS poll is judged by (its socket is gone when the protocol hears of the end): a FIN (no
    error) or a reset is the peer's host speaking; a keepalive or a retransmission giving up is not."""
    from rdzv_server.web.connections import closed_by_peer
    assert closed_by_peer(None) and closed_by_peer(ConnectionResetError()) and closed_by_peer(BrokenPipeError())
    assert not closed_by_peer(TimeoutError(110, "Connection timed out"))
    assert not closed_by_peer(OSError(113, "No route to host"))
