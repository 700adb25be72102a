"""What the agent learns, as facts named in the past tense, reaching the policy one at a time from the
agent's one queue (server link, local workers, signals, the loop's timer). The policy sees nothing else,
so a test can feed it any history with plain numbers for time."""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from node_agent.client.replies import Code, Path, code_of
from protocol.messages import (
    FailureReport,
    JoinRequest,
    LeaveRequest,
    NodeStatus,
    PollRequest,
    StallReport,
    SuccessReport,
    UnhealthyKind,
    WorkerFailure,
)
from protocol.stalls import RankSeen

# Which request a server fact answers: the protocol's request types (names: protocol.codec.REQUEST_TYPES).
Request = (type[JoinRequest] | type[PollRequest] | type[FailureReport] | type[SuccessReport] | type[LeaveRequest]
           | type[StallReport])


@dataclass(frozen=True)
class StatusReceived:
    """The server answered `request` with where this node and its job stand."""
    request: Request
    status: NodeStatus
    sent_at: float               # agent clock when the answered try went out: the lease was renewed after it


@dataclass(frozen=True)
class ServerNotReached:
    """A try of `request` got no answer (connection refused, timeout, server going away)."""
    request: Request
    error: str


@dataclass(frozen=True)
class ServerRefused:
    """The server answered `request` with a typed error a retry would not change (a text code is typed)."""
    request: Request
    code: Code
    message: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "code", code_of(self.code))


@dataclass(frozen=True)
class WorkersExited:
    """The round's local workers ended: the failed ones as soon as any failed, or all of them succeeded."""
    round_id: int
    failures: tuple[WorkerFailure, ...]   # empty: every local worker exited 0


@dataclass(frozen=True)
class NoteDue:
    """A rank of the round told what the server wants at once: a newer snapshot's digest (it compares replicas as
    it hears them), or that it waits after a snapshot (a swap waits for that: rdzv_server/core/swaps.py)."""
    round_id: int


@dataclass(frozen=True)
class RanksStalled:
    """Ranks of the round stopped stepping for longer than the stall threshold: what each local rank is doing
    (again every threshold while the stall lasts; `first`: the first look at this stall)."""
    round_id: int
    threshold_s: float
    ranks: tuple[RankSeen, ...]
    first: bool = True


@dataclass(frozen=True)
class SpawnFailed:
    """The round's workers could not be started."""
    round_id: int
    failure: WorkerFailure


@dataclass(frozen=True)
class SignalReceived:
    """The agent got a signal to stop (SIGTERM, SIGINT, SIGHUP, SIGQUIT)."""
    signum: int


class Verdict(str, enum.Enum):
    """What the witnesses said, together (WitnessesAnswered.verdict)."""
    ROUND_REPLACED = "round_replaced"  # one hears the server and holds a newer round (or none): this node's is over
    STILL_MEMBER = "still_member"      # one hears the server, which still runs this node's round
    SERVER_HEARD = "server_heard"      # one hears the server (an older witness: it names no round)
    SERVER_AWAY = "server_away"        # some answered, none hears the server: the server itself is away
    # None answered, but one took the connection: this node is not cut off (a witness busy, hung, or its port
    # flooded by a stranger); nothing is known of the server, so nothing is concluded
    UNANSWERED = "unanswered"
    SILENT = "silent"                  # none could be reached: this node is cut off from everyone


# The verdicts the server check (a fresh connection) decides between; the others do not wait for it
# (a replaced round is evidence enough, the rest mean "ask again" whatever the server says).
SERVER_CHECK_DECIDES = frozenset({Verdict.SERVER_HEARD, Verdict.SILENT})


@dataclass(frozen=True)
class WitnessesAnswered:
    """What the round's witnesses said (AskWitnesses), and what a fresh connection to the server found
    meanwhile (path_check.py), where the verdict needs it (SERVER_CHECK_DECIDES; None: not waited for)."""
    verdict: Verdict
    server: Path | None = Path.NO_SERVER


class Stage(str, enum.Enum):
    """Where a node check (CheckNode / NodeChecked) was asked for."""
    JOIN = "before joining"
    RESTART = "before restarting"
    RUNNING = "while workers run"
    FAILURE = "after a worker failed"
    STOP = "stopping workers"
    READMIT = "before taking a place again"      # a suspect node (NodeStatus.checks_due)


@dataclass(frozen=True)
class NodeChecked:
    """The node's checks ran (the GPUs through NVML, the site's --health-check, a failure's message, or
    a stop that left workers alive): `problem` None when healthy, else one line and its kind."""
    stage: Stage
    round_id: int                              # the round it was asked for (-1: none)
    problem: str | None = None
    kind: UnhealthyKind | None = None
    failures: tuple[WorkerFailure, ...] = ()   # Stage.FAILURE: the failure, reported when healthy


@dataclass(frozen=True)
class DeadlinePassed:
    """The policy's `next_deadline()` came with no other fact before it."""


Fact = (StatusReceived | ServerNotReached | ServerRefused | WorkersExited | RanksStalled | SpawnFailed
        | SignalReceived | WitnessesAnswered | NodeChecked | DeadlinePassed | NoteDue)

# How a source hands the loop news: a fact, or the exception that broke it (a bug), raised, not waited out.
Put = Callable[[Fact | BaseException], None]
