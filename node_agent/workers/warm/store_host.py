"""The round's c10d store, hosted beside the workers instead of inside worker rank 0.
Run on the group-rank-0 node as `PYTHON -u store_host.py PORT`, started like a worker: a TCPStore server on
MASTER_PORT (READY on stdout) until the round's group stops. Workers get TORCHELASTIC_USE_AGENT_STORE=True, so
every rank is a client of a store already listening (as under torchrun's agent), and none waits out TCPStore's
retry while rank 0 starts listening. It listens on MASTER_ADDR alone where that is an address of this host. A
fresh store per round: torch adds no per-attempt prefix to an agent's store. torch is imported only when run: the
agent imports this module for its path alone.
"""
from __future__ import annotations

import ipaddress
import os
import signal
import socket
import sys

SCRIPT = os.path.abspath(__file__)
READY = "c10d store listening on port"
# =1: the store listens on every interface, as TCPStore's own socket does (an address of this host that peers reach
# through another one: a Kubernetes hostNetwork pod with IPVS service addresses on every node)
ANY_INTERFACE = "NODE_AGENT_STORE_ANY_INTERFACE"


def main() -> None:
    from datetime import timedelta

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(sys.argv[1])
    bound = None if os.environ.get(ANY_INTERFACE) == "1" else listening(addr, port)
    store = TCPStore(addr, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60),
                     master_listen_fd=bound.fileno() if bound is not None else None)
    print(f"{READY} {store.port}", flush=True)
    while True:            # until the agent stops the round's group
        signal.pause()


def listening(addr: str, port: int) -> socket.socket | None:
    """A socket listening on MASTER_ADDR:port where MASTER_ADDR is an address of this host: the store, which
    authenticates nobody, then answers there only (TCPStore's own binds every interface: a management network's
    too). None for a name or an address not here (a NAT's): TCPStore binds every interface, as before."""
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return None
    if ip.is_unspecified:
        return None
    sock = socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        return None
    return sock


if __name__ == "__main__":
    main()
