"""Typed messages exchanged by agents and the server.

Rules that keep the wire open to other implementations:
- every request carries `v`, the protocol version; the server refuses versions it does not speak;
- unknown fields are ignored (an old server reads a newer agent), missing optional fields take defaults;
- a field of the wrong type or out of range is rejected with an error that names it (`$.field`).
Structs are encoded as MessagePack maps keyed by the field names shown here.
"""
from __future__ import annotations

import enum
import re
from typing import Optional

import msgspec

PROTOCOL_VERSION = 1

NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")


class JobState(str, enum.Enum):
    WAITING = "waiting"        # no round running: collecting nodes (first round, or below min after a loss)
    RUNNING = "running"        # a round is assigned and its workers run
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CLOSED = "closed"          # closed by an operator

    @property
    def finished(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CLOSED)


class NodeState(str, enum.Enum):
    WAITING = "waiting"        # admitted, waiting for the next round to complete
    MEMBER = "member"          # in the current round (see assignment)
    SPARE = "spare"            # job is at max nodes: promoted when a member is lost
    EXCLUDED = "excluded"      # failed too often: waits out a cooldown
    GONE = "gone"              # lost, left or never joined: must join again


def _check(cond: bool, field: str, why: str) -> None:
    if not cond:
        raise ValueError(f"{field}: {why}")


class JobConfig(msgspec.Struct, kw_only=True):
    """A job's settings, fixed by its first join. All durations are seconds."""
    min_nodes: int = 1
    max_nodes: int = 1
    max_restarts: int = 3
    last_call_s: float = 3.0
    join_timeout_s: float = 600.0
    lease_timeout_s: float = 5.0
    exclude_after: int = 3             # worker failures of one node within exclude_window_s ...
    exclude_window_s: float = 600.0
    exclude_cooldown_s: float = 60.0   # ... exclude it this long, doubling each time
    exclude_cooldown_max_s: float = 3600.0

    def __post_init__(self) -> None:
        _check(self.min_nodes >= 1, "min_nodes", f"must be >= 1, got {self.min_nodes}")
        _check(self.max_nodes >= self.min_nodes, "max_nodes",
               f"must be >= min_nodes ({self.min_nodes}), got {self.max_nodes}")
        _check(self.max_restarts >= 0, "max_restarts", f"must be >= 0, got {self.max_restarts}")
        _check(self.last_call_s >= 0, "last_call_s", f"must be >= 0, got {self.last_call_s}")
        _check(self.join_timeout_s > 0, "join_timeout_s", f"must be > 0, got {self.join_timeout_s}")
        _check(self.lease_timeout_s > 0, "lease_timeout_s", f"must be > 0, got {self.lease_timeout_s}")
        _check(self.exclude_after >= 0, "exclude_after", f"must be >= 0 (0 disables), got {self.exclude_after}")
        _check(self.exclude_cooldown_s >= 0, "exclude_cooldown_s", f"must be >= 0, got {self.exclude_cooldown_s}")

    def differences(self, other: "JobConfig") -> list[str]:
        """Human-readable `field: ours vs theirs` for every field that differs."""
        return [
            f"{name}: job has {getattr(self, name)!r}, join asked {getattr(other, name)!r}"
            for name in self.__struct_fields__
            if getattr(self, name) != getattr(other, name)
        ]


class _Request(msgspec.Struct, kw_only=True):
    v: int
    node_id: str

    def __post_init__(self) -> None:
        _check(bool(NODE_ID.fullmatch(self.node_id)), "node_id",
               f"must be 1-128 of [A-Za-z0-9._:@-] starting with a letter or digit, got {self.node_id!r}")


class JoinRequest(_Request, kw_only=True):
    """Admit this node to the job, creating the job with `config` if it is new."""
    addr: str                          # address other nodes can reach this node at
    local_world_size: int
    master_port: int                   # a free port on this node, used if it becomes group rank 0
    config: JobConfig = msgspec.field(default_factory=JobConfig)
    instance: str = ""                 # random per agent process: tells a restarted agent from a duplicate
    role: str = "default"
    host: str = ""                     # host name, for operators and failure summaries

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(bool(self.addr), "addr", "must not be empty")
        _check(self.local_world_size >= 1, "local_world_size", f"must be >= 1, got {self.local_world_size}")
        _check(0 <= self.master_port <= 65535, "master_port", f"must be 0..65535, got {self.master_port}")


class PollRequest(_Request, kw_only=True):
    """Long-poll: returns as soon as this node's view differs from `known_round`, else after `wait_s`.

    Every poll renews the node's lease. `known_round` is the round whose workers the agent runs
    (-1 when it runs none). `master_port` refreshes the port published for the next round.
    """
    known_round: int = -1
    wait_s: float = 2.0
    master_port: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(0 <= self.wait_s <= 60, "wait_s", f"must be 0..60, got {self.wait_s}")
        _check(0 <= self.master_port <= 65535, "master_port", f"must be 0..65535, got {self.master_port}")


class WorkerFailure(msgspec.Struct, kw_only=True):
    """One failed worker, as the agent saw it."""
    local_rank: int
    rank: int
    exitcode: int                      # negative: killed by signal -exitcode
    signal: str = ""                   # e.g. "SIGSEGV" when killed by a signal
    reason: str = "exited"             # "exited", "hang", ...
    message: str = ""                  # from the worker's error file when it wrote one
    traceback: str = ""
    timestamp: float = 0.0             # unix time the failure was seen
    host: str = ""
    node_id: str = ""


class FailureReport(_Request, kw_only=True):
    round_id: int
    failures: list[WorkerFailure]

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(len(self.failures) >= 1, "failures", "must name at least one failed worker")


class SuccessReport(_Request, kw_only=True):
    round_id: int


class LeaveRequest(_Request, kw_only=True):
    reason: str = "left"


REQUESTS = (JoinRequest, PollRequest, FailureReport, SuccessReport, LeaveRequest)


class Assignment(msgspec.Struct, kw_only=True):
    """What one node runs in one round. The same round id means the same world for every member."""
    round_id: int
    group_rank: int
    group_world_size: int
    rank_offset: int                   # global rank of this node's local rank 0
    world_size: int                    # sum of all members' local world sizes
    local_world_size: int
    master_addr: str
    master_port: int
    restart_count: int                 # job-wide, the same on every node
    max_restarts: int
    role_rank_offset: int = 0
    role_world_size: int = 0


class NodeStatus(msgspec.Struct, kw_only=True):
    """The server's reply to every agent request: where this node and its job stand now."""
    job_id: str
    job_state: JobState
    node_state: NodeState
    round_id: int                      # the job's current round (-1: none yet)
    restart_count: int
    assignment: Optional[Assignment] = None   # set when node_state is member
    accepted: bool = True              # False: the request was stale (old round) and was not obeyed
    reason: str = ""                   # why things stand as they do (last decision, or why not accepted)
    spare_position: int = -1           # 0-based place in the spare queue
    excluded_for_s: float = 0.0        # cooldown left when excluded
    root_cause: Optional[WorkerFailure] = None  # once FAILED: first failure in time of the round that failed last
    lease_timeout_s: float = 5.0


class ErrorReply(msgspec.Struct, kw_only=True):
    code: str
    message: str
