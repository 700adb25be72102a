"""A failed worker's `WorkerFailure` (exit, hang, spawn error): wall-clock times, as the server compares them
across nodes; texts cut to the protocol's bounds, so a huge error message cannot get the report refused."""
from __future__ import annotations

import time

from node_agent.workers.error_file import read_error_file
from node_agent.workers.process import WorkerExit
from protocol.bounds import MAX_MESSAGE, MAX_TRACEBACK
from protocol.messages import FailureReason, WorkerFailure
from protocol.peer_gone import broken_by_peer

SPAWN_FAILED_EXITCODE = 127    # the shell's "command not found"


def exit_failure(e: WorkerExit, *, host: str, node_id: str, before_group: bool = False) -> WorkerFailure:
    """A worker that exited non-zero (or was killed), with what its error file says; `before_group`: its probe
    saw it start but never begin its process group (no peer's loss broke it)."""
    parsed = read_error_file(e.error_file) if e.error_file else None
    message, tb = parsed[:2] if parsed is not None else ("", "")
    # Ordered by when the agent reaped it: error.json's timestamps are whole seconds.
    return WorkerFailure(local_rank=e.local_rank, rank=e.rank, exitcode=e.exitcode, signal=e.signal_name,
                         message=_head(message, MAX_MESSAGE), traceback=keep_tail(tb, MAX_TRACEBACK),
                         timestamp=e.seen_at or time.time(), host=host, node_id=node_id, before_group=before_group)


EARLY_EXIT_S = 10.0   # a rank that exited 0 this soon before a peer failed is the likelier cause


def early_exits(exits: list[WorkerExit], failed: WorkerFailure, *, host: str, node_id: str) -> list[WorkerFailure]:
    """Ranks that exited 0 shortly before a peer failed, while it still ran: a rank leaving a job mid-training
    breaks its peers' next collective ("Connection closed by peer"), so it, not they, is the root cause. A peer
    with an error of its own (a message that names no broken collective, or a kill) stays its own cause."""
    if not broken_by_peer(failed):
        return []
    return [WorkerFailure(local_rank=e.local_rank, rank=e.rank, exitcode=0, reason=FailureReason.EXITED_EARLY.value,
                          message=f"exited 0 while the other ranks still ran; rank {failed.rank} failed "
                                  f"{failed.timestamp - e.seen_at:.1f}s later",
                          timestamp=e.seen_at, host=host, node_id=node_id)
            for e in exits if e.exitcode == 0 and failed.timestamp - EARLY_EXIT_S <= e.seen_at < failed.timestamp]


def store_failure(e: WorkerExit, *, rank: int, host: str, node_id: str) -> WorkerFailure:
    """The round's c10d store host ended while the workers ran (their store is gone): reported as local rank
    0's, as the protocol has only a worker's fields."""
    how = f"was killed by {e.signal_name}" if e.signal_name else f"exited with status {e.exitcode}"
    return WorkerFailure(local_rank=0, rank=rank, exitcode=e.exitcode or 1, signal=e.signal_name,
                         reason=FailureReason.STORE_EXITED.value,
                         message=f"the round's c10d store, hosted by this node's agent (pid {e.pid}), {how} "
                                 f"while the workers ran (its output: the run directory's store/attempt_N/, kept "
                                 f"with --log-dir)",
                         timestamp=e.seen_at or time.time(), host=host, node_id=node_id)


def spawn_failure(error: OSError, *, local_rank: int, rank: int, program: str, host: str,
                  node_id: str) -> WorkerFailure:
    """A worker that could not be started at all (missing program, no permission, no log directory)."""
    return WorkerFailure(local_rank=local_rank, rank=rank, exitcode=SPAWN_FAILED_EXITCODE,
                         reason=FailureReason.SPAWN_FAILED.value,
                         message=_head(f"cannot start {program!r}: {error.strerror or error}", MAX_MESSAGE),
                         timestamp=time.time(), host=host, node_id=node_id)


def _head(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def keep_tail(text: str, limit: int) -> str:
    """The end of a traceback is the part that names the error: keep that."""
    return text if len(text) <= limit else "..." + text[len(text) - limit + 3:]
