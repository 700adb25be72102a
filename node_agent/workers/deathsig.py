"""A child process dies with the agent (PR_SET_PDEATHSIG(SIGKILL), set between fork and exec) and runs on its
--numa-binding CPUs. Cold workers and the warm zygote (whose children do the same) use it: a dead agent takes all."""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

PR_SET_PDEATHSIG = 1


@functools.cache
def prctl() -> Any:
    """libc's prctl, loaded in the parent so the child does no library loading after fork."""
    if not sys.platform.startswith("linux"):
        return None
    fn = ctypes.CDLL(None, use_errno=True).prctl
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return fn


def child_setup(parent_pid: int, prctl: Any, cpu_affinity: frozenset[int] | None = None) -> None:
    """In the child, after fork: die with the parent, run on the --numa-binding CPUs. A warm worker does the
    same from its launch message (zygote._per_worker_setup): keep the two alike."""
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # The parent may have died between fork and prctl: then no signal will ever come.
    if os.getppid() != parent_pid:
        os._exit(1)
    if cpu_affinity:
        # a CPU taken away since the plan (cgroup change): run unbound rather than not at all
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cpu_affinity)


def preexec(parent_pid: int, prctl: Any, cpu_affinity: frozenset[int] | None = None) -> Callable[[], None]:
    """`child_setup` as a subprocess preexec_fn (runs in the child between fork and exec, after setsid)."""
    return functools.partial(child_setup, parent_pid, prctl, cpu_affinity)
