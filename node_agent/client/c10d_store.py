"""Is a c10d TCPStore listening at an endpoint? (The one reach into torch's private wire protocol.)
torchrun's c10d rendezvous and every job's MASTER_PORT host one, so an agent at the wrong port often finds
one. It never answers HTTP (silent, or a reset), which looks like a stalled server worth waiting for; so
the agent asks the store's own question on a connection of its own: VALIDATE (torch's magic number) then
PING with a nonce, which only a TCPStore echoes. No torch import: tests/integration/test_c10d_store.py
fails if torch changes these bytes."""
from __future__ import annotations

import asyncio
import os
import struct

VALIDATE, PING = 0, 13               # torch's QueryType values (c10d TCPStoreBackend.hpp)
MAGIC = 0x3C85F7CE                   # c10d::detail::validationMagicNumber
PROBE_TIMEOUT_S = 2.0                # a TCPStore answers at once; this only bounds a silent peer


async def answers_as_c10d_store(host: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """True when a c10d TCPStore answers at host:port; False for anything else, unreachable included."""
    try:
        return await asyncio.wait_for(_ping(host, port), timeout)
    except (OSError, EOFError, asyncio.TimeoutError):    # EOFError: asyncio.IncompleteReadError
        return False


async def _ping(host: str, port: int) -> bool:
    nonce = os.urandom(4)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(bytes([VALIDATE]) + struct.pack("<I", MAGIC) + bytes([PING]) + nonce)
        await writer.drain()
        return await reader.readexactly(4) == nonce
    finally:
        writer.close()
