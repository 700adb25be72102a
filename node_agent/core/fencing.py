"""When a node cut off from the server asks its round's witnesses, and what it concludes. No I/O.
policy.py holds the state; the times and wording are here, so the fencing bound (lease + ~1 s) is in one place."""
from __future__ import annotations

import signal

from node_agent.core.facts import Verdict
from protocol.bounds import MAX_MESSAGE
from protocol.messages import FailureReason, WorkerFailure

FENCE_MARGIN_S = 0.5
REPROBE_S = 0.5     # a witness's answer costs one local connection: the fencing bound is the lease + ~1 s
# A witness may not have noticed yet that the server is away for it too (its keepalive runs on its own
# clock): a "cut off" verdict is asked once more this much later.
CONFIRM_S = 1.0
# A silence takes a whole PROBE_TIMEOUT_S and is confirmed by a second ask: the first starts this much
# before the lease lapses, so the second ends about a second after it. Before the lapse only a newer round counts.
EARLY_ASK_S = 1.0


def lapse_at(renewed_at: float | None, unreachable_since: float, lease_timeout_s: float) -> float:
    """When this node's lease must have lapsed on the server (the earliest a silence may fence); it runs
    from when the last answered request went out."""
    lapsed = (renewed_at if renewed_at is not None else unreachable_since) + lease_timeout_s
    return max(lapsed, unreachable_since) + FENCE_MARGIN_S


def first_ask_at(renewed_at: float | None, unreachable_since: float, lease_timeout_s: float) -> float:
    """When to ask the witnesses first: shortly before the lapse, or at once when the failed try comes later
    (a held poll's dead connection is noticed by keepalive up to ~4.5 s after the cut: waiting longer would put
    the fence past lease + 2 s). An early ask costs nothing: its verdict is moot once the server answers."""
    return max(lapse_at(renewed_at, unreachable_since, lease_timeout_s) - EARLY_ASK_S, unreachable_since)


def fenced(verdict: Verdict, silent_s: float, lease_timeout_s: float, rank: int) -> tuple[str, WorkerFailure]:
    """What the node says, and reports for its round, when it stops its workers as the one cut off."""
    seen = ("a witness that hears the server runs a newer round" if verdict == Verdict.ROUND_REPLACED else
            "the round's other nodes still hear the server" if verdict == Verdict.SERVER_HEARD else
            "neither the round's other nodes nor any endpoint answer")
    why = (f"fenced: no answer from the server for {silent_s:.1f}s (lease {lease_timeout_s:g}s), and "
           f"{seen}: this node is cut off, and the server has replaced its round")
    failure = WorkerFailure(local_rank=0, rank=rank, exitcode=-signal.SIGTERM, signal="SIGTERM",
                            reason=FailureReason.FENCED.value, message=why[:MAX_MESSAGE])
    return why, failure
