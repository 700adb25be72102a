"""The keepalive bound holds for a connection cut while it carries data, not only for an idle one: an agent's
request (or the server's answer) sent just as the link went silent ends the connection in about
keepalive.DEAD_AFTER_S, as an idle connection's probes do. Without that bound the kernel retransmits for
minutes, and an agent cut off just after it sent a request can neither see the loss nor fence its workers."""
from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys

import pytest

from node_agent.copies import wire
from protocol import keepalive
from tests.e2e.harness import ROOT
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


FETCH = """
import asyncio, sys
from node_agent.copies import client
got = asyncio.run(client.fetch(sys.argv[1], int(sys.argv[2]), key="k" * 16, node_id="n", local_rank=0,
                               dest_dir=sys.argv[3], timeout_s=float(sys.argv[4])))
print(got.reason, flush=True)
"""


def test_a_fetch_from_a_holder_cut_off_mid_copy_ends_as_lost_within_the_bound(net, tmp_path):
    """A node fetching a snapshot (a spare taking a suspect's place) from a host that vanishes mid-copy: the copy
    client's keepalive ends the fetch in about DEAD_AFTER_S, so the node turns to its next source, not after
    the stall bound (60 s by default; READ_LIMIT_S here, which the fetch would then name as a stall)."""
    listener = net.socket("server")
    keepalive.enable(listener)           # as node_agent/client/listener.py
    listener.bind((net.addr("server"), 0))
    listener.listen(1)
    listener.settimeout(30)
    addr, port = listener.getsockname()
    fetcher = subprocess.Popen(net.exec_argv("a", [sys.executable, "-c", FETCH, addr, str(port), str(tmp_path),
                                                   str(READ_LIMIT_S)]),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONPATH": ROOT})
    served: socket.socket | None = None
    try:
        served, _ = listener.accept()
        served.settimeout(30)
        assert served.recv(512).startswith(b"rdzv-agent fetch ")
        served.sendall(wire.copy_line(7, 10 << 20) + b"x" * (1 << 20))     # a tenth of the copy, then silence
        net.cut("server")
        out, _ = fetcher.communicate(timeout=READ_LIMIT_S + 30)
        assert out.startswith("lost: connection lost after "), out
    finally:
        fetcher.kill()
        fetcher.wait()
        for sock in (served, listener):
            if sock is not None:
                sock.close()
