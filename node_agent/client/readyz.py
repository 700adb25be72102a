"""One path check: an endpoint's `GET /readyz` status over a new connection (path_check.py's request).
The TCP handshake gets `connect_s` (the kernel completes it for a listening server, however busy), TLS
and the answer `answer_s`, and `connected()` is told between them, so a request to a server that is there
but slow is kept (path_check.py). The smallest HTTP/1.1 GET; the status line and headers are read (at most
HEAD_MAX bytes), and a standby's `Rdzv-Leader` header goes to `named()`: where the leader is."""
from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
from collections.abc import Callable
from typing import Any

import yarl

from node_agent.client.deadline import deadline

STATUS_LINE_MAX = 256    # bytes: an HTTP status line is far shorter; anything longer is not an answer
HEAD_MAX = 2048          # bytes of status line and headers read; a leader named past them is not seen
LEADER_HEADER = b"rdzv-leader"
URL_MAX = 512            # a leader's URL longer than this is not taken


async def readyz_status(server: str, *, ssl_context: ssl.SSLContext | None, connect_s: float, answer_s: float,
                        connected: Callable[[], None] = lambda: None, local_host: str | None = None,
                        named: Callable[[str], None] = lambda url: None) -> int | None:
    """`server`'s (`http[s]://host:port`) /readyz status, or None (no connection or status line in time, a TLS
    failure, not HTTP). `ssl_context`: for https (None: the default). `local_host`: the address to connect from.
    `named`: told the leader's URL a standby's answer names."""
    url = yarl.URL(server)
    host, port = url.host or "", url.port or 0
    tls = (ssl_context or ssl.create_default_context()) if url.scheme == "https" else None
    try:
        async with deadline(connect_s):
            sock = await _connect(host, port, local_host)
    except (OSError, asyncio.TimeoutError):
        return None
    connected()
    request = (f"GET /readyz HTTP/1.1\r\nHost: {url.raw_authority or host}\r\nConnection: close\r\n"
               f"Accept: */*\r\n\r\n").encode("ascii")
    try:
        async with deadline(answer_s):
            head = await (_ask(sock, request) if tls is None else _ask_tls(sock, request, tls, host))
    except (OSError, EOFError, asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
            ValueError):
        return None
    finally:
        sock.close()             # the transport's, if TLS got that far: closed already, this is a no-op
    status = _status(head.split(b"\n", 1)[0])
    if status is not None and (leader := _leader(head)):
        named(leader)
    return status


def _leader(head: bytes) -> str | None:
    """The `Rdzv-Leader` header's http(s) URL in a response head, if any (anything else: None)."""
    for line in head.split(b"\n")[1:]:
        name, sep, value = line.partition(b":")
        url = value.strip().decode("ascii", "replace")
        if sep and name.strip().lower() == LEADER_HEADER and len(url) <= URL_MAX \
                and url.startswith(("http://", "https://")) and url.isprintable() and " " not in url:
            return url
    return None


async def _ask(sock: socket.socket, request: bytes) -> bytes:
    """Over the socket itself: no transport or stream objects for a plain check (a fleet's come together).
    The head up to its blank line (or HEAD_MAX bytes, or the server's close)."""
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(sock, request)
    head = b""
    while not _whole(head) and len(head) < HEAD_MAX:
        chunk = await loop.sock_recv(sock, HEAD_MAX - len(head))
        if not chunk:
            break
        head += chunk
    return head.split(b"\r\n\r\n", 1)[0]


async def _ask_tls(sock: socket.socket, request: bytes, tls: ssl.SSLContext, host: str) -> bytes:
    """Over TLS: the handshake is bounded by the caller's `answer_s` deadline with the answer."""
    reader, writer = await asyncio.open_connection(sock=sock, ssl=tls, server_hostname=host, limit=HEAD_MAX)
    try:
        writer.write(request)
        head = await reader.readuntil(b"\n")
        if _whole(head):
            return head
        try:
            return head + await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            return head + exc.partial
        except asyncio.LimitOverrunError:
            return head + await reader.read(HEAD_MAX)
    finally:
        writer.transport.abort()     # the status is all we wanted; no TLS goodbye to wait for


def _whole(head: bytes) -> bool:
    """Enough of an answer read: the whole head, or a status line that is not 503 (only a standby's 503
    names the leader; any other answer is its status line alone, a stranger's garbage included)."""
    if b"\r\n\r\n" in head:
        return True
    return b"\n" in head and _status(head.split(b"\n", 1)[0]) != 503


async def _connect(host: str, port: int, local_host: str | None) -> socket.socket:
    """A non-blocking socket connected to the first of `host`'s addresses that takes the connection."""
    loop = asyncio.get_running_loop()
    try:       # an address as it is (no resolver thread: a fleet's checks come together)
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
        infos: list[tuple[Any, ...]] = [(family, socket.SOCK_STREAM, 0, "", (host, port))]
    except ValueError:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    failure: OSError = OSError(f"{host} has no address")
    for family, kind, proto, _, addr in infos:
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            if local_host is not None:
                sock.bind((local_host, 0))
            await loop.sock_connect(sock, addr)
            return sock
        except OSError as exc:
            failure = exc
            sock.close()
        except BaseException:
            sock.close()
            raise
    raise failure


def _status(line: bytes) -> int | None:
    """`HTTP/1.1 200 OK\\r\\n` -> 200; None for anything that is not a status line."""
    parts = line[:STATUS_LINE_MAX].split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit() or len(parts[1]) != 3:
        return None
    return int(parts[1])

