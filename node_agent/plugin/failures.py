"""torch's worker failures, for the plugin's failure reports. torch passes them to no handler method, so
torch_internals.run_loop_failures finds its ProcessFailures by global rank. Reading them is best effort (attributes
only, no torch import); without them the report says that the node's workers failed, not which."""
from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

from protocol.bounds import MAX_MESSAGE, MAX_TRACEBACK
from protocol.messages import Assignment, WorkerFailure

STOPPED = (-signal.SIGTERM, -signal.SIGKILL)    # how torch stops a node's other workers: no failure of their own


def worker_failures(failures: dict[int, Any] | None, a: Assignment, host: str,
                    at_start: Callable[[int], bool] = lambda local_rank: False) -> list[WorkerFailure]:
    """torch's ProcessFailures by global rank -> the failure report; one generic failure without them. In torch's
    order: the worker that failed first, then those torch stopped. Its stamps are whole seconds, so within one the
    server's root cause (the first by time, a stable sort) is then torch's (get_first_failure), not the lowest rank.
    `at_start(local_rank)`: its probe says it failed at start (before_group), for one that ended on its own only."""
    out = []
    for rank, f in (failures or {}).items():
        try:
            message, tb = f.message, ""
            if isinstance(message, dict):   # an error file written by @record
                tb = str(message.get("extraInfo", {}).get("py_callstack", ""))
                message = message.get("message", "")
            code = int(f.exitcode)
            out.append(WorkerFailure(local_rank=int(f.local_rank), rank=int(rank), exitcode=code,
                                     signal=f.signal_name() if code < 0 else "", message=str(message)[:MAX_MESSAGE],
                                     traceback=tb[-MAX_TRACEBACK:], timestamp=float(f.timestamp or time.time()),
                                     host=host, before_group=code not in STOPPED and at_start(int(f.local_rank))))
        except (AttributeError, TypeError, ValueError):
            continue
    return out or [WorkerFailure(local_rank=0, rank=a.rank_offset, exitcode=1, timestamp=time.time(), host=host,
                                 message="torchrun's agent restarted its workers after a failure "
                                         "(which worker, torch did not say)")]
