"""The keepalive bound holds for a connection cut while it carries data, not only for an idle one: an agent's
request (or the server's answer) sent just as the link went silent ends the connection in about
keepalive.DEAD_AFTER_S, as an idle connection's probes do. Without that bound the kernel retransmits for
minutes, and an agent cut off just after it sent a request can neither see the loss nor fence its workers."""
from __future__ import annotations

import errno
import socket

import pytest

from protocol import keepalive
from tests.multihost import netns

pytestmark = pytest.mark.multihost

# Far past the bound (about 4 s), far short of the kernel's own retransmission limit (minutes): timing out
# here, instead of the connection failing, means the data was retransmitted without end.
READ_LIMIT_S = 4 * keepalive.DEAD_AFTER_S


@pytest.fixture
def net(namespaces):
    n = netns.Network(["server", "a"])
    try:
        yield n
    finally:
        n.close()


@pytest.mark.parametrize("sender", ["agent", "server"])
def test_a_connection_cut_while_its_data_is_unacknowledged_ends_within_the_bound(net, sender):
    listener = net.socket("server")
    keepalive.enable(listener)           # as rdzv_server/serve.py: accepted connections inherit it
    listener.bind((net.addr("server"), 0))
    listener.listen(1)
    agent = net.socket("a")
    keepalive.enable(agent)              # as the agent's client (node_agent/client/transport.py)
    served: socket.socket | None = None
    try:
        agent.connect(listener.getsockname())
        served, _ = listener.accept()
        net.cut("a")
        writer, reader = (agent, agent) if sender == "agent" else (served, served)
        writer.sendall(b"x" * 512)       # unacknowledged from now on: keepalive's probes never start
        reader.settimeout(READ_LIMIT_S)
        with pytest.raises(OSError) as failed:
            reader.recv(1)
        # the read's own time-out has no errno (TimeoutError, as is the connection's ETIMEDOUT)
        assert failed.value.errno is not None, \
            f"the {sender}'s data was still retransmitted {READ_LIMIT_S:g} s after the cut"
        # ended by the bound: timed out, reported as such or as the soft error it last met (no neighbour)
        assert failed.value.errno in (errno.ETIMEDOUT, errno.EHOSTUNREACH), failed.value
    finally:
        for sock in (agent, served, listener):
            if sock is not None:
                sock.close()
