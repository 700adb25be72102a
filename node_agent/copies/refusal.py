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


NO_KEY = " (no key of node "     # a detail's start: this holder holds no copies of the node, nor is it a source


def unheard(r: Refusal, first_line: bytes) -> bool:
    """A refusal our log need not say: a drop of a node's copies where none are held. Harmless and common: the node
    that took a gone node's place fetched its copies and dropped them, and the gone node itself (excluded, its job
    then over) drops them again (a review saw it logged as trouble at every such job's end). The peer is still
    answered "wrong key", as for any key refused."""
    return r.detail.startswith(NO_KEY) and first_line.startswith(b"rdzv-agent drop ")


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
