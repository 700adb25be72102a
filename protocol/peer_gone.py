"""Whether a worker's failure reads as its collective broken by a peer gone (a victim's), not an error of its
own: the agent asks it of early exits (node_agent.workers.failures), the server of a late report's failure
before it moves a round's blame (rdzv_server.core.blame)."""
from __future__ import annotations

from protocol.messages import WorkerFailure

# What a collective says when a peer has gone (gloo, NCCL, torch's store and its wrappers), lower case.
PEER_GONE = ("connection closed", "connection reset", "broken pipe", "distbackenderror", "distnetworkerror",
             "nccl", "gloo", "peer", "socket", "timed out")


def broken_by_peer(failed: WorkerFailure) -> bool:
    """Whether a failure may be a consequence of a peer leaving: it says so, or says nothing (no error file:
    the launcher cannot tell). A worker killed by a signal other than SIGABRT (NCCL's abort) was not."""
    if failed.signal and failed.signal != "SIGABRT":
        return False
    said = f"{failed.message}\n{failed.traceback}".lower()
    return not said.strip() or any(words in said for words in PEER_GONE)
