"""A minimal HTTP/1.1 client over a plain socket: it sends exactly the bytes it is given.

aiohttp's and urllib's clients refuse what a fuzzer must send (control characters in headers, odd
methods, a Content-Length that lies), so requests are built here as bytes and replies parsed with
the few rules a server's answer needs (status line, headers, Content-Length or chunked body).
"""
from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass

MAX_HEAD_BYTES = 256 * 1024
MAX_BODY_BYTES = 64 * 1024 * 1024

Header = tuple["str | bytes", "str | bytes"]


class NoReply(Exception):
    """No (complete) reply: the connection closed, or nothing came before the timeout (`hang`)."""

    def __init__(self, why: str, *, hang: bool = False, got: int = 0) -> None:
        super().__init__(why)
        self.hang = hang
        self.got = got          # bytes of a reply received before it broke off


@dataclass
class Reply:
    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: bytes
    closes: bool = False     # the server ends the connection after this reply

    def header(self, name: str) -> str | None:
        """The last value of header `name` (case-insensitive), or None."""
        found = None
        for key, value in self.headers:
            if key.lower() == name.lower():
                found = value
        return found

    @property
    def content_type(self) -> str:
        return (self.header("Content-Type") or "").split(";")[0].strip().lower()


def _b(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode("utf-8", "surrogateescape")


def request_bytes(method: str | bytes, target: str | bytes, headers: Sequence[Header], body: bytes = b"", *,
                  host: str | None, content_length: bool = True, version: bytes = b"HTTP/1.1") -> bytes:
    """One request as bytes. `host` None sends no Host header; `content_length` False sends none
    (the headers given may carry their own, or Transfer-Encoding)."""
    lines = [_b(method) + b" " + _b(target) + b" " + version]
    if host is not None:
        lines.append(b"Host: " + _b(host))
    lines += [_b(k) + b": " + _b(v) for k, v in headers]
    if content_length:
        lines.append(b"Content-Length: " + str(len(body)).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


class Connection:
    """One kept-alive connection to the server, opened again when the server closed it."""

    def __init__(self, host: str, port: int, timeout: float = 20.0) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self._sock: socket.socket | None = None
        self._buf = b""

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._buf = b""

    def send(self, raw: bytes, *, head: bool = False) -> Reply:
        """Send `raw` (one request) and read its reply. A kept-alive socket the server closed
        meanwhile (no byte of a reply received) is replaced once by a fresh one."""
        fresh = self._sock is None
        if self._sock is None:
            try:
                self._sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
            except OSError as exc:
                raise NoReply(f"cannot connect: {exc}") from None
        try:
            self._sock.sendall(raw)
            reply = self._read_reply(head)
        except TimeoutError:
            self.close()
            raise NoReply(f"no reply within {self.timeout:g} s", hang=True) from None
        except NoReply as exc:
            self.close()
            if fresh or exc.got:
                raise
            return self.send(raw, head=head)
        except OSError as exc:          # reset, broken pipe
            got = len(self._buf)
            self.close()
            if fresh or got:
                raise NoReply(f"connection error: {exc}", got=got) from None
            return self.send(raw, head=head)
        if reply.closes:
            self.close()
        return reply

    # -- reading --
    def _fill(self, want: int, got: int) -> None:
        assert self._sock is not None
        chunk = self._sock.recv(max(65536, want))
        if not chunk:
            raise NoReply("connection closed before a complete reply", got=got + len(self._buf))
        self._buf += chunk

    def _until(self, marker: bytes, limit: int, got: int) -> bytes:
        while marker not in self._buf:
            if len(self._buf) > limit:
                raise NoReply(f"reply head over {limit} bytes", got=got + len(self._buf))
            self._fill(4096, got)
        part, _, self._buf = self._buf.partition(marker)
        return part

    def _exact(self, n: int, got: int) -> bytes:
        while len(self._buf) < n:
            self._fill(n - len(self._buf), got)
        part, self._buf = self._buf[:n], self._buf[n:]
        return part

    def _read_reply(self, head: bool) -> Reply:
        while True:
            head_bytes = self._until(b"\r\n\r\n", MAX_HEAD_BYTES, 0)
            status_line, *header_lines = head_bytes.decode("latin-1").split("\r\n")
            version, _, rest = status_line.partition(" ")
            code, _, reason = rest.partition(" ")
            if not version.startswith("HTTP/") or not code.isdigit():
                raise NoReply(f"not an HTTP status line: {status_line[:80]!r}", got=len(head_bytes))
            headers = [(k.strip(), v.strip()) for k, _, v in (h.partition(":") for h in header_lines)]
            if not 100 <= int(code) < 200:
                break
        reply = Reply(int(code), reason, headers, b"")
        tokens = {t.strip().lower() for t in (reply.header("Connection") or "").split(",")}
        reply.closes = "close" in tokens or (version == "HTTP/1.0" and "keep-alive" not in tokens)
        got = len(head_bytes)
        if head or reply.status in (204, 304):
            return reply
        if "chunked" in (reply.header("Transfer-Encoding") or "").lower():
            reply.body = self._chunked(got)
        elif reply.header("Content-Length") is not None:
            length = int(reply.header("Content-Length") or "0")
            if length > MAX_BODY_BYTES:
                raise NoReply(f"reply body of {length} bytes", got=got)
            reply.body = self._exact(length, got)
        else:                                   # delimited by the end of the connection
            reply.closes = True
            try:
                while len(self._buf) < MAX_BODY_BYTES:
                    self._fill(65536, got)
            except NoReply:
                pass
            reply.body, self._buf = self._buf, b""
        return reply

    def _chunked(self, got: int) -> bytes:
        body = b""
        while True:
            size = int(self._until(b"\r\n", 1024, got).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                self._until(b"\r\n", MAX_HEAD_BYTES, got)      # (no trailers expected) the final CRLF
                return body
            body += self._exact(size, got)
            self._exact(2, got)
