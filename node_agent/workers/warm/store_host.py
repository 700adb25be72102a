"""The round's c10d store, hosted beside the workers instead of inside worker rank 0.
Run on the group-rank-0 node as `PYTHON -u store_host.py PORT`, started like a worker: a TCPStore server on
MASTER_PORT (READY on stdout) until the round's group stops. Workers get TORCHELASTIC_USE_AGENT_STORE=True, so
every rank is a client of a store already listening (as under torchrun's agent), and none waits out TCPStore's
retry while rank 0 starts listening. It listens on MASTER_ADDR alone where that is an address of this host. A
fresh store per round: torch adds no per-attempt prefix to an agent's store. torch is imported only when run: the
agent imports this module for its path alone.

The store authenticates nobody and keeps whatever it is sent (values up to torch's 8 MiB each, keys without end),
so its memory is bounded (RLIMIT_DATA: what it holds at start plus NODE_AGENT_STORE_MEMORY_MB, default 1 GiB): past
it a `set` is refused and its connection closed (torch's store survives its std::bad_alloc), said once, rather than
the host running out of memory and the kernel killing a training worker.
Its descriptors go up to the hard limit: torch's store closes no idle connection, and a stranger's, up to a soft
limit of 1024, kept the round's workers out.
"""
from __future__ import annotations

import ipaddress
import os
import resource
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping

SCRIPT = os.path.abspath(__file__)
READY = "c10d store listening on port"
# =1: the store listens on every interface, as TCPStore's own socket does (an address of this host that peers reach
# through another one: a Kubernetes hostNetwork pod with IPVS service addresses on every node)
ANY_INTERFACE = "NODE_AGENT_STORE_ANY_INTERFACE"
# MiB the store may hold beyond what it uses at start (0: no bound); a real job's keys take a few MiB
MEMORY_MB = "NODE_AGENT_STORE_MEMORY_MB"
DEFAULT_MEMORY_MB = 1024
NEAR_BOUND = 0.9          # said once when the store's data reaches this share of its bound


def main() -> None:
    """`store_host.py PORT` (node-agent: binds MASTER_ADDR:PORT) or `store_host.py --fd N --parent PID` (the torchrun
    plugin: serves a listening socket its parent made and published, and ends when that parent does)."""
    from datetime import timedelta

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    raise_descriptor_limit()
    # kept referenced for the process's life: its socket is the store's (closed when collected)
    listener: socket.socket | None
    if sys.argv[1] == "--fd":
        listener, parent = socket.socket(fileno=int(sys.argv[2])), int(sys.argv[4])
        port = listener.getsockname()[1]
        threading.Thread(target=end_with_parent, args=(parent,), daemon=True).start()
    else:
        port = int(sys.argv[1])
        listener = None if os.environ.get(ANY_INTERFACE) == "1" else listening(addr, port)
    store = TCPStore(addr, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60),
                     master_listen_fd=listener.fileno() if listener is not None else None)
    extra_mb, problem = memory_budget(os.environ)
    if problem:
        say(problem)
    if extra_mb:
        limit = bound_memory(extra_mb << 20)
        threading.Thread(target=watch_memory, args=(limit, extra_mb), daemon=True).start()
    print(f"{READY} {store.port}", flush=True)
    while True:            # until the agent stops the round's group
        signal.pause()


def raise_descriptor_limit() -> None:
    """The soft limit on descriptors up to the hard one: torch's store accepts every connection and closes none, so
    a stranger's idle connections up to the limit (1024: a shell's, systemd's) keep the round's workers out (their
    `init_process_group` fails, a restart used). libuv polls with epoll: descriptors past 1024 are fine."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def end_with_parent(parent: int, every_s: float = 0.5) -> None:
    """Ends this process once `parent` has (it was adopted by another): torchrun's process may end by SIGKILL."""
    while os.getppid() == parent:
        time.sleep(every_s)
    os._exit(0)


def say(message: str) -> None:
    print(f"c10d store host: {message}", file=sys.stderr, flush=True)


def memory_budget(environ: Mapping[str, str]) -> tuple[int, str]:
    """MiB the store may hold beyond its start, and what was wrong with the variable ("" where nothing)."""
    raw = environ.get(MEMORY_MB, "").strip()
    if not raw:
        return DEFAULT_MEMORY_MB, ""
    if raw.isdigit() and len(raw) <= 9:
        return int(raw), ""
    return DEFAULT_MEMORY_MB, (f"{MEMORY_MB}={raw[:40]!r} is not a whole number of MiB (0: no bound): "
                               f"the store holds at most {DEFAULT_MEMORY_MB} MiB")


def data_bytes() -> int:
    """This process's data (private writable memory, what RLIMIT_DATA counts), from /proc."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    return 0


def bound_memory(extra: int) -> int:
    """Limit this process's data to what it holds now plus `extra` bytes (never above a hard limit set from
    outside); the limit."""
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = data_bytes() + extra
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    return limit


def watch_memory(limit: int, extra_mb: int, every_s: float = 1.0) -> None:
    """Says once that the store is near its bound: who fills it is someone the operator should look for."""
    while data_bytes() < NEAR_BOUND * limit:
        time.sleep(every_s)
    say(f"it holds {data_bytes() >> 20} MiB, near its bound of {limit >> 20} MiB ({MEMORY_MB}={extra_mb} beyond its "
        "start): past it a client's `set` is refused and its connection closed. A job's own keys take a few MiB; "
        "something else that reaches MASTER_ADDR:MASTER_PORT may be filling it")


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


def store_socket(addr: str) -> socket.socket:
    """A listening socket on a free port for a store that authenticates nobody: on `addr` alone where that is an
    address of this host (`listening`), else (a name, an address not here, NODE_AGENT_STORE_ANY_INTERFACE=1) on
    every interface, as TCPStore's own."""
    sock = None if os.environ.get(ANY_INTERFACE) == "1" else listening(addr, 0)
    if sock is not None:
        return sock
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True, backlog=socket.SOMAXCONN)
    return socket.create_server(("", 0), backlog=socket.SOMAXCONN)


if __name__ == "__main__":
    main()
