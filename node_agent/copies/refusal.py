"""The holder's refusals (store.py): what a peer is answered, and what our log says besides."""
from __future__ import annotations

import errno

from node_agent.copies import wire
from node_agent.copies.wire import DropRequest, FetchRequest, PushRequest, WireError


class Refusal(Exception):
    """A refusal: `reason` goes to the peer, `detail` to our log only; `kind` names it in the log's counts."""
    def __init__(self, kind: str, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason
        self.detail = detail


def parse(first_line: bytes) -> PushRequest | FetchRequest | DropRequest:
    """The request a first line makes, or a Refusal naming the field that is wrong."""
    try:
        return wire.parse_request(first_line)
    except WireError as exc:
        raise Refusal("bad_request", f"bad request: {exc}") from None


def stored_failed(exc: OSError) -> Refusal:
    """Our own file failed: a full file system is the memory limit; anything else is named as such."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return Refusal("limit", "memory limit full: the holder's file system is full")
    return Refusal("io", f"could not store the copy: {exc.strerror or type(exc).__name__}")
