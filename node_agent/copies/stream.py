"""Moving a copy's bytes, shared by the holder (store.py) and the agents (client.py): lines read with a
bound and a timeout, a payload received into or sent from a file descriptor in CHUNK pieces, hashed as it
passes, and the pacing of a capped sender. Rules: a peer that stops sending or reading for `stall_s` seconds
is given up (StreamError), never waited for forever, and one whose host went is given up sooner (keepalive on
both ends: protocol/keepalive.py); a network failure is a StreamError, while a failure of
our own file (a full /dev/shm) stays an OSError, so the caller can tell "the peer went" from "no room"."""
from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from node_agent.copies.wire import MAX_LINE

CHUNK = 1 << 20
T = TypeVar("T")


class StreamError(Exception):
    """The peer's side broke off: closed, stalled, or sent a line too long; the message says which."""


def pace(sent_bytes: int, elapsed_s: float, rate: float) -> float:
    """Seconds to sleep so that `sent_bytes` after `elapsed_s` seconds keeps to `rate` bytes a second."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 bytes/s, got {rate}")
    return max(0.0, sent_bytes / rate - elapsed_s)


async def within(awaitable: Awaitable[T], timeout_s: float, stalled: str, lost: str) -> T:
    """`awaitable` within `timeout_s`; else StreamError(stalled), or StreamError(lost: why) when the connection
    failed. A socket's own ETIMEDOUT (keepalive's verdict: the peer's host is gone or cut off) is a loss, though
    Python 3.11 raises it as the same TimeoutError as the wait's own, which has no errno."""
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except OSError as exc:
        if isinstance(exc, TimeoutError) and exc.errno is None:
            raise StreamError(stalled) from None
        raise StreamError(f"{lost}: {exc}") from exc       # (the cause: closed_by_peer)
    except asyncio.TimeoutError:        # Python 3.10: not an OSError
        raise StreamError(stalled) from None


def closed_by_peer(exc: BaseException) -> bool:
    """`exc` (a StreamError or OSError) says the peer closed or reset the connection: its choice, or its process gone,
    not a stall or a host cut off."""
    return isinstance(exc, (BrokenPipeError, ConnectionResetError)) or \
        isinstance(exc.__cause__, (BrokenPipeError, ConnectionResetError))


async def read_line(reader: asyncio.StreamReader, timeout_s: float) -> bytes:
    """One line (with its newline, or what came before the end); StreamError when none came in time."""
    try:
        line = await within(reader.readline(), timeout_s, f"no line within {timeout_s:g} s", "connection lost")
    except ValueError:          # past the reader's own limit, far past MAX_LINE
        raise StreamError(f"a line longer than {MAX_LINE} bytes") from None
    if not line:
        raise StreamError("the peer closed the connection")
    return line


def widen(reader: asyncio.StreamReader, limit: int = CHUNK) -> None:
    """Let `reader` buffer up to about 2 x `limit` bytes: a payload's chunks, after a first line read into a small
    buffer (node_agent/client/listener.py). StreamReader takes its limit only when made; this sets the attribute
    it keeps it in, asyncio's own (tests/unit/test_listener.py fails should asyncio rename it)."""
    reader._limit = limit     # type: ignore[attr-defined]


def write_all(fd: int, data: bytes) -> None:
    """All of `data` into `fd` (os.write may take a part)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


async def receive(reader: asyncio.StreamReader, fd: int, size: int, stall_s: float,
                  count: Callable[[int], None] = lambda n: None) -> str:
    """Exactly `size` bytes from the peer into `fd`; their sha256 in hex. `count(n)` after each piece."""
    digest = hashlib.sha256()
    done = 0
    while done < size:
        chunk = await within(reader.read(min(CHUNK, size - done)), stall_s,
                             f"stalled: no bytes for {stall_s:g} s after {done} of {size}",
                             f"connection lost after {done} of {size} bytes")
        if not chunk:
            raise StreamError(f"short stream: {done} of {size} bytes came")
        # In a thread: hashing a chunk takes about a millisecond, the agent's loop serves leases meanwhile.
        await asyncio.to_thread(_hash_and_write, digest, fd, chunk)   # ENOSPC: OSError, for the caller to name
        done += len(chunk)
        count(len(chunk))
    return digest.hexdigest()


async def drain(writer: asyncio.StreamWriter, stall_s: float) -> None:
    """Wait until the peer took what was written; StreamError when it reads nothing for `stall_s`."""
    await within(writer.drain(), stall_s, f"stalled: the peer read nothing for {stall_s:g} s", "connection lost")


async def send(writer: asyncio.StreamWriter, fd: int, size: int, stall_s: float, *, rate: float | None = None,
               count: Callable[[int], None] = lambda n: None) -> str:
    """The first `size` bytes of `fd` to the peer (pread: an unlinked file still reads); their sha256 in hex.
    `rate`: bytes a second at most (None: no cap). A file shorter than `size` is a StreamError."""
    digest = hashlib.sha256()
    done = 0
    start = time.monotonic()
    while done < size:
        chunk = await asyncio.to_thread(_read_and_hash, digest, fd, min(CHUNK, size - done), done)
        if not chunk:
            raise StreamError(f"the file ended after {done} of {size} bytes")
        writer.write(chunk)
        await drain(writer, stall_s)
        done += len(chunk)
        count(len(chunk))
        if rate is not None:
            delay = pace(done, time.monotonic() - start, rate)
            if delay > 0:
                await asyncio.sleep(delay)
    return digest.hexdigest()


def _hash_and_write(digest: Any, fd: int, chunk: bytes) -> None:
    digest.update(chunk)
    write_all(fd, chunk)


def _read_and_hash(digest: Any, fd: int, n: int, offset: int) -> bytes:
    chunk = os.pread(fd, n, offset)
    digest.update(chunk)
    return chunk
