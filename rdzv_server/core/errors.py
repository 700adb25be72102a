"""The one exception the rendezvous core raises: a request it cannot obey, with a typed code."""
from __future__ import annotations

from protocol.errors import ErrorCode


class RendezvousError(Exception):
    def __init__(self, code: ErrorCode, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.headers = headers or {}    # extra HTTP headers for the reply (WWW-Authenticate, ...)
