"""Replies written straight to a connection, and the response aiohttp is then given in their place.

A held long-poll woken by a change is answered during the wake itself (a header from a template, the
encoded view, one `transport.write`), not by resuming each poll's task through aiohttp one after the
other, which made the last of many nodes hear of a new round seconds late. The poll's task catches up
afterwards and returns `AlreadyWritten`: aiohttp writes nothing more and keeps the connection.
"""
from __future__ import annotations

import functools
import time
from email.utils import formatdate

from aiohttp import web
from aiohttp.http import SERVER_SOFTWARE, HttpVersion11

from protocol.codec import CONTENT_TYPE, encode
from protocol.messages import NodeStatus

_HEAD = ("HTTP/1.1 200 OK\r\nContent-Type: " + CONTENT_TYPE + "\r\nContent-Length: {length}\r\n"
         "Date: {date}\r\nServer: " + SERVER_SOFTWARE + "\r\n\r\n")


class AlreadyWritten(web.StreamResponse):
    """Returned once the reply went out by other means: aiohttp writes nothing more (`keep_alive`: keep it open)."""

    def __init__(self, *, keep_alive: bool = False) -> None:
        super().__init__()
        self._keep_alive = keep_alive

    async def prepare(self, request: web.BaseRequest) -> None:
        return None

    async def write_eof(self, data: bytes = b"") -> None:
        return None


class DirectReply:
    """Writes one 200 MessagePack reply to a request's connection, at most once (`sent`: it did)."""

    __slots__ = ("_request", "sent")

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.sent = False

    @staticmethod
    def fits(request: web.Request) -> bool:
        """Only HTTP/1.1 keeping its connection: aiohttp answers the rest (HTTP/1.0, `Connection: close`)."""
        return request.version == HttpVersion11 and request.keep_alive

    def __call__(self, status: NodeStatus) -> bool:
        """Write `status` as the reply now; False (nothing written) when the connection is gone or closing."""
        transport = self._request.transport
        if self.sent or transport is None or transport.is_closing():
            return False
        body = encode(status)
        transport.write(_HEAD.format(length=len(body), date=_http_date(int(time.time()))).encode("latin-1") + body)
        self.sent = True
        return True


@functools.lru_cache(maxsize=1)
def _http_date(second: int) -> str:
    """The Date header's value (RFC 9110), formatted once a second."""
    return formatdate(second, usegmt=True)
