"""Idle connections from many loopback sources against an agent's ports, and a witness question: what a stranger
does in benchmarks/bench_copy_faults.py --flood."""
from __future__ import annotations

import asyncio
import socket
import time

SOURCES = 100           # attacking addresses, 127.0.0.2 ...


def ask(port: int, source: str = "127.0.0.1") -> bytes:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2, source_address=(source, 0)) as s:
            s.sendall(b"rdzv-agent ask round=0\n")
            return s.recv(256)
    except OSError:
        return b""


async def flood(ports: tuple[int, ...], per_port: int, seconds: float) -> dict:
    """per_port idle connections to each port, each reopened once the agent closes it, for `seconds`."""
    loop = asyncio.get_running_loop()
    lived: list[float] = []        # how long a connection the agent accepted lived (closed at once: near 0)
    refused = 0
    end = time.monotonic() + seconds

    async def one(port: int, k: int) -> None:
        nonlocal refused
        source = f"127.0.0.{2 + k % SOURCES}"
        while time.monotonic() < end:
            s = socket.socket()
            s.setblocking(False)
            try:
                s.bind((source, 0))
                await loop.sock_connect(s, ("127.0.0.1", port))
                opened = time.monotonic()
                try:
                    got = await asyncio.wait_for(loop.sock_recv(s, 1), max(0.0, end - time.monotonic()))
                    if got == b"":
                        lived.append(time.monotonic() - opened)
                except asyncio.TimeoutError:
                    pass
                except ConnectionResetError:
                    lived.append(time.monotonic() - opened)
            except OSError:
                refused += 1
                await asyncio.sleep(0.05)
            finally:
                s.close()

    await asyncio.gather(*(one(p, k) for p in ports for k in range(per_port)))
    lived.sort()
    return {"closed": len(lived), "connect_failed": refused,
            "closed_at_once": sum(t < 0.5 for t in lived),
            "lived_s_max": round(lived[-1], 2) if lived else None,
            "lived_s_p99": round(lived[int(0.99 * (len(lived) - 1))], 2) if lived else None}
