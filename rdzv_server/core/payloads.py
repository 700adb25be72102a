"""Typed payloads of the events the status page, the metrics and `rdzv-ctl events` read. `Event.data` stays a plain
map, written with `as_data` and read with `payload_of`, so a misspelt key is a type error, not a silent `.get()`
default. A map that does not fit (written by an older server) reads as None.
"""
from __future__ import annotations

from typing import Any

import msgspec

from protocol.messages import WorkerFailure
from rdzv_server.core.events import EventKind


class RoundFormed(msgspec.Struct, kw_only=True, omit_defaults=True):
    """round_completed: the round's size, why and how fast it formed."""
    nodes: int
    world_size: int
    reason: str
    cause: str                        # a RoundCause value
    formation_s: float | None = None  # from the decision to form it (or the first node waiting) to now
    since_failure_s: float | None = None   # from the failure that caused it to now
    promoted: int = 0                 # spares taken into it
    # a node that took the place (group rank, and so global ranks) of one gone since the last round -> that node
    took: dict[str, str] = msgspec.field(default_factory=dict)
    ranks: list[str] = msgspec.field(default_factory=list)   # node ids by group rank (rounds of up to 64 nodes)


class RoundWaiting(msgspec.Struct, kw_only=True):
    """round_waiting: the round dissolved below min nodes, and what caused it."""
    cause: str


class WorkerFailed(msgspec.Struct, kw_only=True):
    """worker_failed: one worker's failure, as its node reported it."""
    rank: int
    local_rank: int
    exitcode: int
    signal: str
    reason: str
    host: str
    message: str

    @classmethod
    def of(cls, f: WorkerFailure) -> WorkerFailed:
        return cls(rank=f.rank, local_rank=f.local_rank, exitcode=f.exitcode, signal=f.signal, reason=f.reason,
                   host=f.host, message=f.message)


class WorkersFailed(msgspec.Struct, kw_only=True):
    """worker_failed, once per report for the failures past the first few: how many more, and why."""
    count: int
    reason: str


class JobResized(msgspec.Struct, kw_only=True):
    min_nodes: int
    max_nodes: int


class LeasesExtended(msgspec.Struct, kw_only=True):
    """leases_extended: how long the server was away (or heard from nobody)."""
    away_s: float


class NodeUnhealthy(msgspec.Struct, kw_only=True):
    """node_unhealthy: the kind of fault the node found (a protocol UnhealthyKind value) and its host."""
    kind: str
    host: str


class RankWas(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One rank of a hang, as its node saw it (a RankState value; its main thread's frames, innermost first)."""
    rank: int
    node_id: str
    state: str
    stalled_s: float
    where: str = ""
    stack: str = ""
    call: str = ""            # waiting: the torch call it waits in
    io_bytes: int = 0         # its process's reads and writes while watched
    process_cpu: float = 0.0  # its process's CPU while watched, every thread, in CPUs
    gpu_busy: int = -1        # its GPU's utilization while watched, % (-1: none read)


class HangDetected(msgspec.Struct, kw_only=True, omit_defaults=True):
    """hang_detected: the culprit rank, whether a limit decided (not certain evidence), and every rank reported."""
    culprit: int
    capped: bool
    ranks: list[RankWas]
    kind: str = ""            # a hangs.StallKind value: culprit, deadlock, alone, moving
    limit_s: float = 0.0      # the limit that decided it (capped)
    odd: list[int] = msgspec.field(default_factory=list)   # a deadlock's ranks whose call differs


class StallSeen(msgspec.Struct, kw_only=True, omit_defaults=True):
    """ranks_alone, long_collective, hang_excused: a stall shown, not decided (a hang only after `limit_s`)."""
    kind: str                 # a hangs.StallKind value: alone, moving
    culprit: int              # the rank apart (alone), or the one a limit would name
    stalled_s: float
    limit_s: float            # 0: never decided
    place: str                # where it went its own way: its outermost frames down to it, one per line
    ranks: list[RankWas]
    excused_round: int = -1   # hang_excused: the round a limit decided a hang at this place


Payload = (RoundFormed | RoundWaiting | WorkerFailed | WorkersFailed | JobResized | LeasesExtended | NodeUnhealthy
           | HangDetected | StallSeen)

_TYPES: dict[EventKind, tuple[type[Payload], ...]] = {
    EventKind.ROUND_COMPLETED: (RoundFormed,),
    EventKind.ROUND_ABANDONED: (RoundWaiting,),
    EventKind.WORKER_FAILED: (WorkersFailed, WorkerFailed),
    EventKind.JOB_RESIZED: (JobResized,),
    EventKind.LEASES_EXTENDED: (LeasesExtended,),
    EventKind.NODE_UNHEALTHY: (NodeUnhealthy,),
    EventKind.HANG_DETECTED: (HangDetected,),
    EventKind.RANKS_ALONE: (StallSeen,),
    EventKind.LONG_COLLECTIVE: (StallSeen,),
    EventKind.HANG_EXCUSED: (StallSeen,),
}


def as_data(payload: Payload | None) -> dict[str, Any]:
    """The map an event keeps for `payload`."""
    data: dict[str, Any] = {} if payload is None else msgspec.to_builtins(payload)
    return data


def payload_of(kind: EventKind | str, data: dict[str, Any] | None) -> Payload | None:
    """The typed payload of an event of `kind` with `data` (None: the kind has none, or it does not fit)."""
    try:
        types = _TYPES[EventKind(kind)]
    except (ValueError, KeyError):
        return None
    for cls in types:
        try:
            return msgspec.convert(data or {}, cls)
        except msgspec.ValidationError:
            continue
    return None
