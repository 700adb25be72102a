"""Node credentials: a request may act for a node only with the secret its join was given.

The shell makes a fresh random secret for every join; the core keeps only its SHA-256 digest in
the node's record (saved with the job) and hands the secret back once, in the reply to the join
that created the record. Every later request for the node must carry it: without one the request
is `unauthorized`, with another node's (or a stale agent's) it is `forbidden`, and either way it
changes nothing. A record made without a secret (in-process tests, a store from before
credentials) is owned by its join's `instance` string instead.
"""
from __future__ import annotations

import hashlib
import hmac

from protocol.errors import ErrorCode
from rdzv_server.core.errors import RendezvousError
from rdzv_server.core.records import NodeRecord


def digest(credential: str) -> str:
    return hashlib.sha256(credential.encode()).hexdigest() if credential else ""


def owns(node: NodeRecord, credential: str, instance: str) -> bool:
    """Whether a join with `credential` (and `instance`) comes from the agent that owns `node`."""
    if not node.credential_digest:
        return node.instance == instance
    return bool(credential) and hmac.compare_digest(digest(credential), node.credential_digest)


def check(node: NodeRecord, credential: str) -> None:
    """Raise unless `credential` is the node's (a node made without one accepts any); once it is,
    the node's agent is known to hold its secret."""
    verify(node, credential)
    proven(node)


def verify(node: NodeRecord, credential: str) -> None:
    """`check` without noting anything: for a request that may still be refused after it (a
    refused request changes nothing)."""
    if not node.credential_digest:
        return
    if not credential:
        raise RendezvousError(ErrorCode.UNAUTHORIZED, f"a request for node {node.node_id} must carry the "
                              "credential its join was given")
    if not hmac.compare_digest(digest(credential), node.credential_digest):
        raise RendezvousError(ErrorCode.FORBIDDEN, f"the credential is not node {node.node_id}'s: another agent "
                              "joined with this node id and took the node over (or the request is forged)")


def proven(node: NodeRecord) -> None:
    """A request with the node's credential was accepted: its agent holds its secret."""
    if node.credential_digest:
        node.credential_used = True
