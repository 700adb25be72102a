"""The agent sets GLOO_SOCKET_IFNAME only when the host name would make gloo advertise loopback."""
from __future__ import annotations

import socket

import pytest

from node_agent.workers.interfaces import gloo_interface, interface_of


def test_the_loopback_interface_is_found_by_its_address():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("203.0.113.77") is None            # an address no interface here has


def test_nothing_is_set_when_the_user_did_or_the_node_is_on_loopback_or_the_name_resolves_elsewhere():
    assert gloo_interface("10.1.2.3", {"GLOO_SOCKET_IFNAME": "eth1"}, "localhost") is None
    assert gloo_interface("127.0.0.1", {}, "localhost") is None     # a one-host job: loopback is right
    assert gloo_interface("10.1.2.3", {}, "name-that-does-not-resolve.invalid") is None


def test_a_name_resolving_to_loopback_makes_the_agent_name_the_interface_of_its_address():
    addrs = [a for _, name in socket.if_nameindex() if name != "lo"
             for a in [_ipv4(name)] if a is not None]
    if not addrs:
        pytest.skip("this machine has no interface with an IPv4 address besides loopback")
    chosen = gloo_interface(addrs[0], {}, "localhost")     # "localhost" resolves to 127.0.0.1
    assert chosen is not None and chosen[0] == interface_of(addrs[0]) and "GLOO_SOCKET_IFNAME" in chosen[1]


def _ipv4(name: str) -> str | None:
    import fcntl
    import struct
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(raw[20:24])
