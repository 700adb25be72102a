"""What a stall report says of each rank that stopped stepping (StallReport): its state and its evidence."""
from __future__ import annotations

import enum
from typing import Annotated

import msgspec
from msgspec import Meta

from protocol.bounds import MAX_LOCAL_WORLD_SIZE, MAX_TRACEBACK, Count, Rank, Seconds, ShortText


class RankState(str, enum.Enum):
    """What a rank that stopped stepping is doing, as its agent saw it (node_agent/core/stalls.py)."""
    WAITING = "waiting"        # blocked in a collective or a wait on the others, its CPU idle
    WORKING = "working"        # computing, loading data or writing: busy, moving data, or in torch's code
    QUIET = "quiet"            # idle outside any collective: asleep or blocked in its own code
    SPINNING = "spinning"      # busy in its own code, the same stack at every look, no I/O
    STOPPED = "stopped"        # stopped (SIGSTOP, a debugger)
    EXITED = "exited"          # ended while the others go on
    UNKNOWN = "unknown"        # idle, and no stack to tell where (no probe answered)

    @property
    def certain(self) -> bool:
        """A rank in this state cannot come to the next collective: ranks waiting on it hang, for certain."""
        return self in CERTAIN_STATES

    @property
    def apart(self) -> bool:
        """Neither waiting nor certain: at work on its own (evaluating, uploading) or hung there; a limit decides."""
        return self in APART_STATES


CERTAIN_STATES = (RankState.STOPPED, RankState.EXITED)     # the likelier culprit first (core/hangs.py)
APART_STATES = (RankState.SPINNING, RankState.QUIET, RankState.UNKNOWN, RankState.WORKING)

GPU_BUSY = 50           # RankSeen.gpu_busy at or above this, %: the GPU computes (a kernel ran most of the time)


class RankSeen(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """One stalled rank's evidence."""
    rank: Rank
    local_rank: Annotated[int, Meta(ge=0, le=MAX_LOCAL_WORLD_SIZE)]
    state: RankState
    stalled_s: Seconds                 # since its last step
    steps: Count = 0
    cpu: Annotated[float, Meta(ge=0, le=1.0)] = 0.0   # its main thread's share of one CPU while it was watched
    where: ShortText = ""              # its main thread's innermost frame, "file:line in function"
    stack: Annotated[str, Meta(max_length=MAX_TRACEBACK)] = ""   # the main thread's frames, innermost first
    exitcode: int | None = None
    call: ShortText = ""               # waiting: the torch call it waits in ("barrier", "recv", "backward", ...)
    io_bytes: Count = 0                # its process read and wrote this many bytes while watched
    # its process's CPU while watched, every thread, in CPUs (a collective copies its data in torch's threads)
    process_cpu: Annotated[float, Meta(ge=0, le=MAX_LOCAL_WORLD_SIZE)] = 0.0
    gpu_busy: Annotated[int, Meta(ge=-1, le=100)] = -1   # its GPU's utilization while watched, % (-1: none read)
