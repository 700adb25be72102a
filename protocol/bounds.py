"""The wire's bounds: every field's limit and the value types built on them (docs/protocol.md lists them). One
hostile value must not poison a job's arithmetic, its store record or its status page. Floats must be finite (a
range check refuses NaN and inf)."""
from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from protocol.quoting import quote

MAX_NODES = 100_000                  # nodes in one job
MAX_LOCAL_WORLD_SIZE = 4096          # workers on one node
MAX_RESTARTS = 1_000_000
MAX_EXCLUDE_AFTER = 1000             # worker failures counted against one node (JobConfig.exclude_after)
MAX_DURATION_S = 7 * 24 * 3600.0     # any timeout or window: a week
MAX_ROUND = 2 ** 53                  # round ids and counters stay exact as JSON numbers
MAX_UNIX_TIME = 32503680000.0        # year 3000
MAX_SHORT_TEXT = 256                 # addresses, host names, roles, instances, signal names
MAX_REASON = 1024                    # a leave's reason
MAX_MESSAGE = 4096                   # a worker's error message
MAX_TRACEBACK = 16384
MAX_CREDENTIAL = 64
MAX_POLL_WAIT_S = 60.0               # agents ask for this and let the server choose the hold
MAX_COMMAND = 64                     # a join's command fingerprint
MAX_REPLICAS = 4                     # peer copies of each node's snapshots (JobConfig.replicas)
MAX_STOP_S = 600.0                   # how long a stopped agent's workers may take to stop (LeaveRequest)
MAX_PREPARE_S = 60.0                 # a node joined not ready says it is within this (its agent starts cold after)

RoundRef = Annotated[int, Meta(ge=-1, le=MAX_ROUND)]
Nodes = Annotated[int, Meta(ge=1, le=MAX_NODES)]
Workers = Annotated[int, Meta(ge=1, le=MAX_LOCAL_WORLD_SIZE)]
Port = Annotated[int, Meta(ge=0, le=65535)]
Rank = Annotated[int, Meta(ge=0, le=MAX_NODES * MAX_LOCAL_WORLD_SIZE)]
Seconds = Annotated[float, Meta(ge=0, le=MAX_DURATION_S)]
PositiveSeconds = Annotated[float, Meta(gt=0, le=MAX_DURATION_S)]
UnixTime = Annotated[float, Meta(ge=0, le=MAX_UNIX_TIME)]
ShortText = Annotated[str, Meta(max_length=MAX_SHORT_TEXT)]
Count = Annotated[int, Meta(ge=0, le=MAX_ROUND)]
Bytes = Annotated[int, Meta(ge=0, le=2 ** 62)]


def check(cond: bool, field: str, why: str) -> None:
    if not cond:
        raise ValueError(f"{field}: {why}")


def printable(**fields: str) -> None:
    """Names and addresses end up in logs and on screens: no control characters (unlike worker messages)."""
    for name, value in fields.items():
        check(value.isprintable(), name, f"must not contain control characters, got {quote(value)}")
