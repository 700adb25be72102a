"""The port a round's store is offered on: free now, bound a moment later by another process (node-agent's store
host, or worker rank 0 under the torchrun plugin). By default the kernel picks it (bind to port 0), as torchrun's
agent does: a port of the ephemeral range, which docs/deploy.md's firewall rule allows. NODE_AGENT_STORE_PORTS=
LOW-HIGH takes a free one of that range instead: for a firewall that names the store's ports, or a host where
many processes bind port 0 at once (the test suite's), where the kernel may hand the port offered to one of them
before the store binds it (EADDRINUSE: the round costs the job a restart)."""
from __future__ import annotations

import errno
import itertools
import os
import random
import re
import socket
from collections.abc import Mapping

STORE_PORTS = "NODE_AGENT_STORE_PORTS"
TRIES = 32          # random picks, before the range is walked through


def store_ports(environ: Mapping[str, str] = os.environ) -> range | None:
    """NODE_AGENT_STORE_PORTS as a range of ports (None: not set); ValueError naming it where it is no LOW-HIGH
    (or PORT) of ports 1024-65535."""
    text = environ.get(STORE_PORTS, "").strip()
    if not text:
        return None
    m = re.fullmatch(r"(\d{1,5})(?:\s*-\s*(\d{1,5}))?", text)
    low, high = (int(m[1]), int(m[2] or m[1])) if m else (0, 0)
    if not 1024 <= low <= high <= 65535:
        raise ValueError(f"${STORE_PORTS}={text[:40]!r}: give LOW-HIGH (or one PORT), ports 1024-65535 "
                         f"(e.g. 29500-29599)")
    return range(low, high + 1)


def free_port(addr: str = "", environ: Mapping[str, str] = os.environ) -> int:
    """A port free right now on this machine, of NODE_AGENT_STORE_PORTS where it is set (see the top). OSError when
    none can be bound (out of descriptors, or every port of the range taken)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        ports = store_ports(environ)
    except ValueError:
        ports = None        # said at start-up (node-agent's options, the plugin's settings)
    with socket.socket(family, socket.SOCK_STREAM) as s:
        if ports is None:
            s.bind(("", 0))
            return int(s.getsockname()[1])
        pick = random.Random()      # its own state: a forked copy of the module's would repeat its picks
        start = pick.randrange(len(ports))
        order = itertools.chain((ports[pick.randrange(len(ports))] for _ in range(TRIES)),    # (made as tried:
                                (ports[(start + i) % len(ports)] for i in range(len(ports))))  # each poll asks)
        for port in order:
            try:
                s.bind(("", port))
                return port
            except OSError:
                continue
    raise OSError(errno.EADDRINUSE, f"no free port in {ports.start}-{ports.stop - 1} (${STORE_PORTS})")
