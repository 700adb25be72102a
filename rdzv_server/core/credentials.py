"""Node credentials: a request may act for a node only with the secret its join was given (once, in the reply).
The record keeps only its SHA-256 digest. Without it a request is `unauthorized`, with another's `forbidden`; either
way it changes nothing. A record made without one (in-process tests, an older store) is owned by its `instance`.
"""
from __future__ import annotations

import hashlib
import hmac

from protocol.errors import ErrorCode
from rdzv_server.core.errors import RendezvousError
from rdzv_server.core.records import NodeRecord


def digest(credential: str) -> str:
    return hashlib.sha256(credential.encode()).hexdigest() if credential else ""


def replica_key(credential: str) -> str:
    """The job's key for its members' peer copies, derived one-way from its creator's secret (no copy without one):
    members learn it from their assignments, and it never tells them the creator's credential."""
    return hmac.new(credential.encode(), b"rdzv replica key", hashlib.sha256).hexdigest()[:48] if credential else ""


def copy_token(replica_key: str, node_id: str, epoch: int = 0) -> str:
    """A node's token for its peer copies (`replica_key` never leaves the server): what it pushes and fetches its
    own copies with; a holder learns its sources' tokens in its assignment, so no node acts for another. `epoch`:
    a new one each time the node is a member again after another node was told its token (it took the node's
    place and fetched its copies): that node may not act for it afterwards (rounds.copy_epochs)."""
    if not replica_key:
        return ""
    what = b"copies of " + node_id.encode() + (b"#%d" % epoch if epoch else b"")
    return hmac.new(replica_key.encode(), what, hashlib.sha256).hexdigest()[:48]


def owns(node: NodeRecord, credential: str, instance: str) -> bool:
    """Whether a join with `credential` (and `instance`) comes from the agent that owns `node`."""
    if not node.credential_digest:
        return node.instance == instance
    return bool(credential) and hmac.compare_digest(digest(credential), node.credential_digest)


def succeeds(node: NodeRecord, predecessor: str, instance: str) -> bool:
    """Whether a join of another agent instance with `predecessor` (the secret the node's record was given) comes
    from the next agent of the one that owns `node`: it read the secret from the node's memory. A record made
    without a secret (in-process tests, an older store) is succeeded by any other instance."""
    if not instance or instance == node.instance:
        return False
    if not node.credential_digest:
        return True
    return bool(predecessor) and hmac.compare_digest(digest(predecessor), node.credential_digest)


def verify(node: NodeRecord, credential: str) -> None:
    """Raise unless `credential` is the node's (a node made without one accepts any); notes nothing: the request
    may still be refused, and a refusal changes nothing (`proven` notes it once the request is accepted)."""
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
