"""Addresses as the server compares them: a node's own word against what its connection shows."""
from __future__ import annotations

import ipaddress


def same_host(seen: str, addr: str) -> bool:
    """Whether two addresses are one (a connection's source and the address a node gave, or two sources): an IPv4
    one as a dual-stack socket sees it too."""
    try:
        return _plain(ipaddress.ip_address(seen)) == _plain(ipaddress.ip_address(addr))
    except ValueError:
        return seen == addr


def _plain(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip
