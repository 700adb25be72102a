"""The harness itself: hosts reach each other, each fault silences exactly what it should (no error
to the sender, as on a real cut), and nothing outlives a network."""
from __future__ import annotations

import os
import socket
import subprocess

import psutil
import pytest

from tests.e2e.harness import wait_until
from tests.multihost import netns

pytestmark = pytest.mark.multihost
RECONNECT_LIMIT_S = 10.0
PROBE_TIMEOUT_S = 1.0   # loopback-fast links: a SYN answered takes microseconds, a lost one never returns


@pytest.fixture
def net(namespaces):
    n = netns.Network(["server", "a", "b"])
    try:
        yield n
    finally:
        n.close()


@pytest.fixture
def listen(net):
    """listen(host) -> port of a listening socket on that host (closed at teardown: an open socket
    would keep its namespace alive)."""
    opened: list[socket.socket] = []

    def make(host: str) -> int:
        sock = net.socket(host)
        opened.append(sock)
        sock.bind((net.addr(host), 0))
        sock.listen(16)       # the kernel completes handshakes; nothing needs to accept them
        return int(sock.getsockname()[1])

    yield make
    for sock in opened:
        sock.close()


def reach(net: netns.Network, src: str, dst: str, port: int) -> str:
    """'ok', or the way the connection failed ('timeout' for silence, else the error's name)."""
    sock = net.socket(src)
    sock.settimeout(PROBE_TIMEOUT_S)
    try:
        sock.connect((net.addr(dst), port))
        return "ok"
    except TimeoutError:
        return "timeout"
    except OSError as exc:
        return type(exc).__name__
    finally:
        sock.close()


def test_cut_link_drops_traffic_silently_until_reconnected(net, listen):
    port = listen("b")
    assert reach(net, "a", "b", port) == "ok"
    net.cut("b")
    assert reach(net, "a", "b", port) == "timeout"      # no RST, no ICMP: silence
    net.reconnect("b")
    # the kernel applies the carrier change a moment later (netns.reconnect): until then a SYN is
    # still lost, so the path is asked again until it answers (bounded), not once
    wait_until(lambda: reach(net, "a", "b", port) == "ok", RECONNECT_LIMIT_S, "b reachable after reconnect")


def test_partition_separates_exactly_two_hosts(net, listen):
    ports = {h: listen(h) for h in ("server", "a", "b")}
    net.partition("a", "server")
    assert reach(net, "a", "server", ports["server"]) == "timeout"
    assert reach(net, "server", "a", ports["a"]) == "timeout"
    assert reach(net, "a", "b", ports["b"]) == "ok"
    assert reach(net, "b", "server", ports["server"]) == "ok"
    net.heal("a", "server")
    assert reach(net, "a", "server", ports["server"]) == "ok"


def test_one_way_loss_drops_one_direction_between_two_hosts_at_the_switch(net, listen):
    ports = {h: listen(h) for h in ("server", "a", "b")}
    net.one_way("a", "server")
    assert reach(net, "a", "server", ports["server"]) == "timeout"    # the SYN is lost
    assert reach(net, "server", "a", ports["a"]) == "timeout"         # the SYN arrives, its SYN-ACK is lost
    assert reach(net, "a", "b", ports["b"]) == "ok"
    assert reach(net, "b", "server", ports["server"]) == "ok"
    net.heal_one_way("a", "server")
    assert reach(net, "a", "server", ports["server"]) == "ok"


def test_close_kills_what_runs_inside_and_removes_the_namespaces(namespaces):
    n = netns.Network(["a"])
    sleeper = subprocess.Popen(n.exec_argv("a", ["sleep", "600"]), start_new_session=True)
    try:
        wait_until(lambda: sleeper.pid in n.pids("a"), 10, "the sleeper inside host a")
        n.close()
        assert sleeper.wait(10) == -9
        assert not [ns for ns in os.listdir(netns.NETNS_DIR) if ns.startswith(n.name)]
    finally:
        sleeper.kill()
        n.close()


def test_sweep_removes_networks_of_dead_owners_only(namespaces):
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert not psutil.pid_exists(gone.pid)
    abandoned = f"{netns.PREFIX}{gone.pid}-000000-a"
    mine = f"{netns.PREFIX}{os.getpid()}-000000-a"
    try:
        netns.ip("netns", "add", abandoned)
        netns.ip("netns", "add", mine)
        assert abandoned in netns.sweep_abandoned()
        names = os.listdir(netns.NETNS_DIR)
        assert abandoned not in names and mine in names
    finally:
        netns.delete_namespace(abandoned)
        netns.delete_namespace(mine)
