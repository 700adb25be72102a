"""How far behind the server runs (rdzv_server/looplag.py): connections waiting in its accept queue
count, as a stalled loop does: a node's next poll may be among them (leases.py waits for it)."""
from __future__ import annotations

import socket
import sys
import time

import pytest

from rdzv_server import looplag
from rdzv_server.looplag import ACCEPT_WAIT_S, INTERVAL_S, LoopLagMeter


@pytest.mark.skipif(sys.platform != "linux", reason="the accept queue is read from Linux's TCP_INFO")
def test_connections_waiting_to_be_accepted_count_as_the_server_being_behind():
    probe = LoopLagMeter()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        probe.watch_listener(listener)
        assert probe.accept_queue() == 0 and probe.recent_s() == 0.0
        clients = [socket.create_connection(listener.getsockname()) for _ in range(2)]
        try:
            assert probe.accept_queue() == 2 and probe.recent_s() >= ACCEPT_WAIT_S
            accepted = [listener.accept()[0] for _ in clients]
            assert probe.accept_queue() == 0 and probe.recent_s() == 0.0
            for conn in accepted:
                conn.close()
        finally:
            for c in clients:
                c.close()
    assert probe.accept_queue() == 0                  # a closed listener says nothing


def test_requests_that_waited_for_the_server_count_as_it_being_behind(monkeypatch):
    # a loop can run its timers on time while the requests it handles had waited seconds to be read
    probe = LoopLagMeter()
    probe.note_waited(INTERVAL_S / 2)                  # handled about when it came: not behind
    assert probe.recent_s() == 0.0
    for waited in (0.3, 1.7, 0.9):                     # a burst of late requests ...
        probe.note_waited(waited)
    assert probe.recent_s() == 1.7                     # ... the worst of them
    still = time.monotonic()                           # one instant: a preempted loop would span more entries
    monkeypatch.setattr(looplag.time, "monotonic", lambda: still)
    for _ in range(10_000):
        probe.note_waited(0.2)
    assert len(probe._recent) <= 2, "each request's wait kept: a list growing with the request rate"
    assert probe.recent_s() == 1.7
