"""Free ports for the servers tests start (etcd members, slurmctld/slurmd, rdzv-servers, torchrun).

Ports come from below Linux's ephemeral range (32768-60999), as 29500 and 2379 do: a port from the
kernel's own pick (bind to 0) is an ephemeral one, which the kernel may hand out again as some
client's source port before the test's server listens on it (EADDRINUSE), and a client retrying to
connect to it can even connect to itself.
"""
from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable

LOW, HIGH = 20000, 32000


def free_ports(n: int) -> list[int]:
    """`n` distinct ports that nothing listens on or is bound to now."""
    ports: list[int] = []
    for _ in range(100 * n):
        port = random.randint(LOW, HIGH)
        if port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise AssertionError(f"fewer than {n} free ports in {LOW}-{HIGH}")


def free_port() -> int:
    return free_ports(1)[0]


@contextlib.asynccontextmanager
async def loopback_server(handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
                          tls: ssl.SSLContext | None = None) -> AsyncIterator[int]:
    """An asyncio server on 127.0.0.1 calling `handle` for each connection; yields its port, closed after."""
    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=tls)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()
