"""Addresses as the server compares them: a node's own word against what its connection shows, and where the
members of a round reach each other (a loopback address is no use to another host)."""
from __future__ import annotations

import functools
import ipaddress

from rdzv_server.core.records import NodeRecord, RoundRecord


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


def reachable_addresses(nodes: list[NodeRecord]) -> list[str]:
    """The address other members reach each node at: its own, unless loopback on a multi-host round (they would hang
    on their own); then its join's source address, or if that is loopback too, the server's address they reached."""
    if all(_loopback(n.addr) and _loopback(n.seen_from or n.addr) for n in nodes):
        return [n.addr for n in nodes]          # one host: loopback is right
    server = next((n.server_addr for n in nodes if n.server_addr and not _loopback(n.server_addr)), "")
    return [n.addr if not _loopback(n.addr) else
            n.seen_from if n.seen_from and not _loopback(n.seen_from) else server or n.addr for n in nodes]


def master_correction(r: RoundRecord, master: NodeRecord) -> str:
    """Why round `r`'s MASTER_ADDR is not its group-rank-0 node's own `addr` ("": it is)."""
    if r.addrs[0] == master.addr:
        return ""
    return (f"node {master.node_id} advertises the loopback address {master.addr}, which the other hosts "
            f"cannot reach; MASTER_ADDR is {r.addrs[0]} instead (start its agent with --local-addr to choose)")


@functools.lru_cache(maxsize=1 << 16)
def _loopback(addr: str) -> bool:
    # Cached: every round formation asks it about every member, and parsing an address is slow.
    try:
        return ipaddress.ip_address(addr.split("%", 1)[0]).is_loopback
    except ValueError:
        return addr == "localhost"
