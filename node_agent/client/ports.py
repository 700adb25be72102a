"""The port a round's store is offered on: free now, bound a moment later by another process (the store host
or worker rank 0), so it is taken below the kernel's ephemeral range where the range leaves room. A port from
bind(0) lies inside that range, and any process's outgoing connection on this machine can be handed it before
the store binds it: the store then fails with EADDRINUSE and the round costs the job a restart."""
from __future__ import annotations

import random
import socket

EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST = 10000     # below: the ports services are configured on (databases, exporters, web servers)
TRIES = 32


def ephemeral_start(path: str = EPHEMERAL_RANGE) -> int:
    """The first port the kernel hands to outgoing connections (Linux's default where it cannot be read)."""
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(addr: str = "", *, below: int | None = None) -> int:
    """A port free right now on this machine, below the ephemeral range when there is room (see the top), else
    one the kernel picks. Raises OSError only when no port at all can be bound (out of descriptors)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    top = ephemeral_start() if below is None else below
    with socket.socket(family, socket.SOCK_STREAM) as s:
        if top - LOWEST >= 1000:
            pick = random.Random()     # its own state: a forked process's copy of the module's would repeat
            for _ in range(TRIES):
                port = pick.randrange(LOWEST, top)
                try:
                    s.bind(("", port))
                    return port
                except OSError:
                    continue
        s.bind(("", 0))
        return int(s.getsockname()[1])
