"""Every reach of the plugin into torch's private or undocumented parts, in one place.

torch gives a rendezvous handler neither its workers' failures nor torchrun's --nproc-per-node,
--max-restarts and --role, and its c10d store classes are typed only in a private stub. What the
plugin needs of them is read here, each with the documented route it would prefer:
- the failures of the workers torch is about to restart: torch's run loop holds them
  (`SimpleElasticAgent._invoke_run`'s local `run_result`, a `RunResult` whose `failures` maps a
  global rank to a `ProcessFailure`), and the `ChildFailedError` leaving the launcher carries them at
  the end. torch's elastic events API records worker failures only when `run()` ends, never at a
  restart, and each worker's error file sits where torch's LogsSpecs put it, out of a handler's
  sight: so the run loop's frame it is;
- the key prefix of torch's exit barrier (`_TERMINAL_STATE_SYNC_ID`), which is how a handler learns
  that this node's workers all succeeded;
- torchrun's own argument parser (`torch.distributed.run.get_args_parser`,
  `determine_local_world_size`), for the flags torch does not pass to a handler;
- the c10d store types (`torch._C._distributed_c10d`): torch.distributed re-exports them only at run
  time, so the type checker finds them here; and a store's `timeout`, missing from the stub.

Checked with torch 2.13.0 (the build `make` installs): tests/plugin/test_torch_internals.py fails,
naming the missing piece, on a torch where any of these is renamed or moved.
"""
from __future__ import annotations

import contextlib
import io
import sys
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType
from typing import Any, cast

from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

__all__ = ["EXIT_BARRIER", "PrefixStore", "RUN_LOOP", "RUN_RESULT", "Store", "TCPStore", "TorchrunArgs",
           "run_loop_failures", "store_timeout", "torchrun_args"]

try:
    from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID as EXIT_BARRIER
except ImportError:   # pragma: no cover - a torch that moved it; the value from 2.3 to 2.13
    EXIT_BARRIER = "torchelastic/agent/terminal_state"

RUN_LOOP = "_invoke_run"      # SimpleElasticAgent's monitor loop, which calls next_rendezvous on a restart
RUN_RESULT = "run_result"     # its local holding the last RunResult


def run_loop_failures(exc: BaseException | None) -> dict[int, Any] | None:
    """torch's ProcessFailures by global rank: from `exc` (a ChildFailedError) or from the run loop
    that is calling us; None when neither holds them."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        return failures
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == RUN_LOOP:
            found = getattr(frame.f_locals.get(RUN_RESULT), "failures", None)
            return found if isinstance(found, dict) else None
        frame = frame.f_back
    return None


@dataclass(frozen=True)
class TorchrunArgs:
    """What torchrun's command line says that torch does not pass to a rendezvous handler."""
    rdzv_backend: str
    rdzv_id: str
    local_world_size: int
    max_restarts: int
    role: str


def torchrun_args(argv: list[str]) -> TorchrunArgs | None:
    """torchrun's reading of `argv` (None when it is not a torchrun line torch's parser accepts)."""
    from torch.distributed.run import determine_local_world_size, get_args_parser
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args, _ = get_args_parser().parse_known_args(argv)
        return TorchrunArgs(rdzv_backend=str(args.rdzv_backend), rdzv_id=str(args.rdzv_id),
                            local_world_size=int(determine_local_world_size(args.nproc_per_node)),
                            max_restarts=int(args.max_restarts), role=str(args.role))
    except (SystemExit, Exception):   # best effort: --rdzv-conf local_world_size/max_restarts give them too
        return None


def store_timeout(store: Store) -> timedelta:
    """A store's operation timeout (a property every c10d store has; the stub leaves it out)."""
    return cast(timedelta, getattr(store, "timeout"))   # noqa: B009 - not in the stub: getattr keeps mypy honest
