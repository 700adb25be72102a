"""Every reach of the plugin into torch's private or undocumented parts, in one place. torch gives a handler
neither its workers' failures nor --nproc-per-node, --max-restarts and --role, and types its stores in a private stub:
- the failures of the workers torch is about to restart: `SimpleElasticAgent._invoke_run`'s local `run_result`
  (`RunResult.failures`: global rank -> `ProcessFailure`), at the end the `ChildFailedError` leaving the launcher.
  torch's events API records failures only when `run()` ends, and the workers' error files are where torch's
  LogsSpecs put them, out of a handler's sight: so the run loop's frame it is;
- the key prefix of torch's exit barrier (`_TERMINAL_STATE_SYNC_ID`): how a handler learns its workers succeeded;
- torch's launch configuration (`launch_agent`'s locals `config`, `entrypoint`, `args`): workers per node, restart
  budget, role, script; there whoever called the launcher (torchrun, accelerate, elastic_launch), unlike sys.argv;
- the c10d store types (torch.distributed re-exports them only at run time: typed here) and `timeout` (unstubbed).
Checked with torch 2.13.0: tests/plugin/test_torch_internals.py fails, naming the piece, where one has moved."""
from __future__ import annotations

import os
import sys
from datetime import timedelta
from types import FrameType
from typing import Any, cast

from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from node_agent.plugin.settings import TorchLaunch

__all__ = ["EXIT_BARRIER", "LAUNCH_AGENT", "LAUNCH_LOCALS", "PrefixStore", "RUN_LOOP", "RUN_PATH", "RUN_RESULT",
           "Store", "TCPStore", "launch_settings", "run_loop_failures", "store_timeout"]

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


LAUNCH_AGENT = "launch_agent"                         # torch.distributed.launcher.api: makes the handler
LAUNCH_LOCALS = ("config", "entrypoint", "args")       # its LaunchConfig, and what each worker runs
RUN_PATH = "run_script_path"                           # torchrun --run-path's entrypoint


def launch_settings() -> TorchLaunch | None:
    """What torch's launcher, which is calling us, was configured with; None when no launcher is below
    us or its locals are not what torch 2.13 keeps there."""
    from torch.distributed.launcher.api import LaunchConfig
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_name != LAUNCH_AGENT:
        frame = frame.f_back
    if frame is None:
        return None
    config, entrypoint, args = (frame.f_locals.get(name) for name in LAUNCH_LOCALS)
    if not isinstance(config, LaunchConfig) or not isinstance(config.nproc_per_node, int) \
            or not isinstance(config.max_restarts, int):
        return None
    argv = tuple(str(a) for a in args) if isinstance(args, (list, tuple)) else ()
    kind, script, script_args = _worker_command(entrypoint, argv)
    return TorchLaunch(local_world_size=config.nproc_per_node, max_restarts=config.max_restarts,
                       role=str(config.role), kind=kind, script=script, script_args=script_args)


def _worker_command(entrypoint: object, argv: tuple[str, ...]) -> tuple[str, str, tuple[str, ...]]:
    """(kind, script, args) of what each worker runs, as node-agent names them (cli/job_identity.py), from
    torch's layout (run.py's config_from_args): `PYTHON -u [-m] SCRIPT ARGS`, `run_script_path(SCRIPT, ARGS)`
    with --run-path, `PROGRAM ARGS` with --no-python; a function given to elastic_launch by its name."""
    if isinstance(entrypoint, str):
        python = os.environ.get("PYTHON_EXEC", sys.executable)
        if entrypoint == python and argv[:1] == ("-u",) and len(argv) > 1:
            if argv[1] == "-m" and len(argv) > 2:
                return "module", argv[2], argv[3:]
            return "python", argv[1], argv[2:]
        return "program", entrypoint, argv
    name = str(getattr(entrypoint, "__qualname__", type(entrypoint).__name__))
    if name == RUN_PATH and argv:
        return "run-path", argv[0], argv[1:]
    return "function", name, argv


def store_timeout(store: Store) -> timedelta:
    """A store's operation timeout (a property every c10d store has; the stub leaves it out)."""
    return cast(timedelta, getattr(store, "timeout"))   # noqa: B009 - not in the stub: getattr keeps mypy honest
