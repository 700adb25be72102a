"""Attacks below the request level for `make fuzz`: malformed HTTP, slow clients, idle connections.

Each raw request goes on a fresh connection, closed once the first line of a reply came (aiohttp
drops a request whose client half-closed, so the client never does). The outcome is the reply's
status, "closed" (the server hung up without one), "waiting" (a request incomplete on purpose that
the server still waits on) or "hang" (no reply within the limit to a complete request). Slow
clients dribble a header line or a body a few bytes at a time; idle connections send nothing.
Whether and when the server drops them is reported; that it keeps answering /healthz meanwhile is
checked by soak.py.
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

H = b"Host: 127.0.0.1\r\n"
JOIN = b"POST /v1/jobs/raw-job/join HTTP/1.1\r\n" + H + b"Content-Type: application/msgpack\r\n"
BODY = b"\x82\xa1v\x01\xa7node_id\xa1n"

RAW_REQUESTS: list[tuple[str, bytes]] = [
    ("garbage", b"GARBAGE\r\n\r\n"),
    ("binary", bytes(range(256)) + b"\r\n\r\n"),
    ("empty lines", b"\r\n\r\n\r\n\r\n"),
    ("method only", b"GET\r\n\r\n"),
    ("http/0.9", b"GET /\r\n"),
    ("http/9.9", b"GET /healthz HTTP/9.9\r\n" + H + b"\r\n"),
    ("http/1.0 no host", b"GET /v1/status HTTP/1.0\r\n\r\n"),
    ("lf line ends", b"GET /healthz HTTP/1.1\nHost: 127.0.0.1\n\n"),
    ("nul in line", b"GET /heal\x00thz HTTP/1.1\r\n" + H + b"\r\n"),
    ("space in target", b"GET /v1/jobs/a b HTTP/1.1\r\n" + H + b"\r\n"),
    ("utf-8 target", "GET /v1/jobs/\u00e9\u202e HTTP/1.1\r\n".encode() + H + b"\r\n"),
    ("100 kB target", b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\n" + H + b"\r\n"),
    ("100 kB header", b"GET /healthz HTTP/1.1\r\n" + H + b"X-Big: " + b"a" * 100_000 + b"\r\n\r\n"),
    ("10,000 headers", b"GET /healthz HTTP/1.1\r\n" + H + b"X-N: v\r\n" * 10_000 + b"\r\n"),
    ("header without colon", b"GET /healthz HTTP/1.1\r\n" + H + b"NoColonHere\r\n\r\n"),
    ("obs-fold header", b"GET /healthz HTTP/1.1\r\n" + H + b"X-A: a\r\n b\r\n\r\n"),
    ("nul in header", b"GET /healthz HTTP/1.1\r\n" + H + b"X-A: a\x00b\r\n\r\n"),
    ("negative length", JOIN + b"Content-Length: -1\r\n\r\n" + BODY),
    ("text length", JOIN + b"Content-Length: abc\r\n\r\n" + BODY),
    ("two lengths", JOIN + b"Content-Length: 5\r\nContent-Length: 9\r\n\r\n" + BODY),
    ("huge length", JOIN + b"Content-Length: 99999999999999999999\r\n\r\n" + BODY),
    ("length over 1 MiB", JOIN + b"Content-Length: 2000000\r\n\r\n" + BODY),
    ("truncated body", JOIN + b"Content-Length: 100\r\n\r\n" + BODY),
    ("length and chunked", JOIN + b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
    ("bad chunk size", JOIN + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n" + BODY + b"\r\n0\r\n\r\n"),
    ("huge chunk size", JOIN + b"Transfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\n" + BODY),
    ("chunk without end", JOIN + b"Transfer-Encoding: chunked\r\n\r\n10\r\n" + BODY),
    ("gzip, chunked", JOIN + b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n"),
    ("unknown transfer coding", JOIN + b"Transfer-Encoding: x-fuzz\r\n\r\n" + BODY),
    ("smuggled second request", JOIN + b"Content-Length: 0\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"0\r\n\r\nGET /v1/admin/jobs/raw-job/close HTTP/1.1\r\n" + H + b"\r\n"),
    ("expect without body", JOIN + b"Expect: 100-continue\r\nContent-Length: 10\r\n\r\n"),
    ("websocket upgrade", b"GET /healthz HTTP/1.1\r\n" + H + b"Connection: Upgrade\r\nUpgrade: websocket\r\n"
     b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"),
    ("h2c upgrade", b"GET /healthz HTTP/1.1\r\n" + H + b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
     b"HTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n"),
    ("http/2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
    ("tls client hello", bytes.fromhex("16030100a5010000a10303") + bytes(32) + b"\x00\x00\x02\x13\x01\x01\x00"),
    ("connect", b"CONNECT 127.0.0.1:22 HTTP/1.1\r\n" + H + b"\r\n"),
    ("absolute target", b"GET http://evil.example/v1/status HTTP/1.1\r\n" + H + b"\r\n"),
    ("200 pipelined", (b"GET /healthz HTTP/1.1\r\n" + H + b"\r\n") * 200),
]


@dataclass
class RawResults:
    sent: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)      # "label -> status/closed/hang"
    statuses: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)


# Requests that are incomplete on purpose: the server may wait for the rest (not a hang).
INCOMPLETE = {"truncated body", "chunk without end", "huge chunk size", "huge length", "empty lines", "http/0.9"}
INCOMPLETE_WAIT_S = 2.0
PAUSE_S = 0.005         # between two raw requests of a lane: the drawn requests keep most of the CPU


async def raw_request(port: int, label: str, data: bytes, limit_s: float, results: RawResults) -> None:
    """Send one raw request and read the first reply line. Outcomes: the status, "closed" (hung up without
    a reply), "waiting" (an incomplete request the server still waits on), "hang" (no reply in `limit_s`)."""
    results.sent += 1
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), limit_s)
    except (OSError, asyncio.TimeoutError) as exc:
        results.problems.append(f"{label}: cannot connect ({exc})")
        results.statuses["connect failed"] += 1
        return
    try:
        writer.write(data)
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), INCOMPLETE_WAIT_S if label in INCOMPLETE else limit_s)
        outcome = line.split(b" ")[1].decode() if line.startswith(b"HTTP/") and b" " in line else "closed"
    except asyncio.TimeoutError:
        outcome = "waiting" if label in INCOMPLETE else "hang"
    except OSError:
        outcome = "closed"
    finally:
        writer.close()
    results.outcomes[f"{label} -> {outcome}"] += 1
    results.statuses[outcome] += 1
    if outcome.startswith("5") or outcome == "hang":
        results.problems.append(f"{label}: {outcome} ({data[:80]!r})")


async def raw_flood(port: int, stop: asyncio.Event, limit_s: float, results: RawResults) -> None:
    """Send the RAW_REQUESTS catalogue over and over until `stop` is set: the complete requests one after
    another, each incomplete one in a lane of its own (the server may keep it waiting)."""
    complete = [(label, data) for label, data in RAW_REQUESTS if label not in INCOMPLETE]

    async def lane(requests: list[tuple[str, bytes]]) -> None:
        i = 0
        while not stop.is_set():
            label, data = requests[i % len(requests)]
            await raw_request(port, label, data, limit_s, results)
            i += 1
            await asyncio.sleep(PAUSE_S)
    await asyncio.gather(lane(complete), *(lane([r]) for r in RAW_REQUESTS if r[0] in INCOMPLETE))


@dataclass
class HeldConnection:
    kind: str
    opened: float
    closed_after_s: float | None = None      # when the server hung up (None: still open at the end)


async def hold(port: int, kind: str, stop: asyncio.Event, conns: list[HeldConnection], every_s: float = 1.0) -> None:
    """One slow or idle client until `stop`: 'slow-headers' sends a header byte per `every_s`, 'slow-body'
    a body byte of a 100 kB request, 'idle' nothing after connecting."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        conns.append(HeldConnection(kind, time.monotonic(), 0.0))
        return
    held = HeldConnection(kind, time.monotonic())
    conns.append(held)
    head = {"slow-headers": b"GET /healthz HTTP/1.1\r\n" + H + b"X-Slow: ",
            "slow-body": JOIN + b"Content-Length: 100000\r\n\r\n"}.get(kind, b"")
    try:
        if head:
            writer.write(head)
        while not stop.is_set():
            if kind != "idle":
                writer.write(b"a")
                await writer.drain()
            try:
                if await asyncio.wait_for(reader.read(4096), every_s) == b"":
                    held.closed_after_s = time.monotonic() - held.opened
                    return
            except asyncio.TimeoutError:
                pass
    except OSError:
        held.closed_after_s = time.monotonic() - held.opened
    finally:
        writer.close()
