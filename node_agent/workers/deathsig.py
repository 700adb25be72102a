"""A child process dies with the agent: PR_SET_PDEATHSIG(SIGKILL), set between fork and exec.

Shared by the cold workers (process.py) and the warm zygote (warm/client.py): the zygote's own children
set the same on the zygote, so a SIGKILLed agent takes them all.
"""
from __future__ import annotations

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
    fn.restype = ctypes.c_int
    return fn


def child_setup(parent_pid: int, prctl: Any) -> Callable[[], None]:
    def setup() -> None:   # runs in the child between fork and exec (after Popen's setsid)
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        # The agent may have died between fork and prctl: then no signal will ever come.
        if os.getppid() != parent_pid:
            os._exit(1)
        # TODO(--numa-binding): the cold path's per-worker setup (os.sched_setaffinity) runs here; the warm
        # path's twin is zygote.Zygote._become_worker (the same launch-driven step, in the forked child).
    return setup
