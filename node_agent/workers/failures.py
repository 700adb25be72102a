"""A failed worker's `WorkerFailure` (exit, hang, spawn error): wall-clock times, as the server compares them
across nodes; texts cut to the protocol's bounds, so a huge error message cannot get the report refused."""
from __future__ import annotations

import signal
import time

from node_agent.workers.error_file import read_error_file
from node_agent.workers.launch import WorkerLaunch
from node_agent.workers.process import WorkerExit
from protocol.messages import MAX_MESSAGE, MAX_TRACEBACK, WorkerFailure

SPAWN_FAILED_EXITCODE = 127    # the shell's "command not found"


def exit_failure(e: WorkerExit, *, host: str, node_id: str) -> WorkerFailure:
    """A worker that exited non-zero (or was killed), with what its error file says."""
    parsed = read_error_file(e.error_file) if e.error_file else None
    message, tb = parsed[:2] if parsed is not None else ("", "")
    # Ordered by when the agent reaped it: error.json's timestamps are whole seconds.
    return WorkerFailure(local_rank=e.local_rank, rank=e.rank, exitcode=e.exitcode, signal=e.signal_name,
                         message=_head(message, MAX_MESSAGE), traceback=_tail(tb, MAX_TRACEBACK),
                         timestamp=e.seen_at or time.time(), host=host, node_id=node_id)


def store_failure(e: WorkerExit, *, rank: int, host: str, node_id: str) -> WorkerFailure:
    """The round's c10d store host ended while the workers ran (their store is gone): reported as local rank
    0's, as the protocol has only a worker's fields."""
    how = f"was killed by {e.signal_name}" if e.signal_name else f"exited with status {e.exitcode}"
    return WorkerFailure(local_rank=0, rank=rank, exitcode=e.exitcode or 1, signal=e.signal_name, reason="store exited",
                         message=f"the round's c10d store, hosted by this node's agent (pid {e.pid}), {how} "
                                 f"while the workers ran (its output: the run directory's attempt_N/store/)",
                         timestamp=e.seen_at or time.time(), host=host, node_id=node_id)


def hang_failure(launch: WorkerLaunch, *, silent_s: float, hang_timeout_s: float, host: str,
                 node_id: str) -> WorkerFailure:
    """A worker that stopped beating: the agent stops it with SIGTERM."""
    return WorkerFailure(local_rank=launch.local_rank, rank=launch.rank, exitcode=-signal.SIGTERM,
                         signal="SIGTERM", reason="hang",
                         message=f"no heartbeat for {silent_s:.1f}s (hang timeout {hang_timeout_s:g}s); stopped",
                         timestamp=time.time(), host=host, node_id=node_id)


def spawn_failure(error: OSError, *, local_rank: int, rank: int, program: str, host: str,
                  node_id: str) -> WorkerFailure:
    """A worker that could not be started at all (missing program, no permission, no log directory)."""
    return WorkerFailure(local_rank=local_rank, rank=rank, exitcode=SPAWN_FAILED_EXITCODE, reason="spawn failed",
                         message=_head(f"cannot start {program!r}: {error.strerror or error}", MAX_MESSAGE),
                         timestamp=time.time(), host=host, node_id=node_id)


def _head(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _tail(text: str, limit: int) -> str:
    """The end of a traceback is the part that names the error: keep that."""
    return text if len(text) <= limit else "..." + text[len(text) - limit + 3:]
