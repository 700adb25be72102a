"""What the agent does, as actions named in the imperative: the policy returns them, the loop runs them
in order. They carry the policy's reason, which the narration shows."""
from __future__ import annotations

import signal
from dataclasses import dataclass

from node_agent.core.facts import Stage
from protocol.messages import Assignment, UnhealthyKind, Witness, WorkerFailure
from protocol.stalls import RankSeen


@dataclass(frozen=True)
class Spawn:
    """Start this node's workers for the assignment's round."""
    assignment: Assignment


@dataclass(frozen=True)
class StopWorkers:
    """Stop the local workers (`signum`, then SIGKILL after --stop-timeout). `finish_writes`: the agent's own stop
    (its signal): their snapshot writes under way end first (workers/writes.py)."""
    reason: str
    signum: int = signal.SIGTERM
    finish_writes: bool = False


@dataclass(frozen=True)
class ReportFailure:
    round_id: int
    failures: tuple[WorkerFailure, ...]


@dataclass(frozen=True)
class SendNote:
    """Send the round's progress note now, in a poll of its own (new snapshot digests, ranks held)."""


@dataclass(frozen=True)
class HoldAtSnapshot:
    """Ask the round's ranks to wait after their next snapshot (`on`), or no longer: a suspect is swapped there."""
    on: bool


@dataclass(frozen=True)
class KeepFrom:
    """Ask the round's ranks to keep their snapshots from `step` on besides their keep rule (-1: no longer): the
    oldest of the job's peer copies is of that step (NodeStatus.copies_floor); and the newest their keep rule lets
    go where it is of `held` or later: the slowest rank's newest may be of it (NodeStatus.held_floor)."""
    step: int
    held: int = -1


@dataclass(frozen=True)
class ReportStall:
    """Tell the server what the round's stalled ranks are doing: it decides whether the job hangs."""
    round_id: int
    threshold_s: float
    ranks: tuple[RankSeen, ...]


@dataclass(frozen=True)
class ReportSuccess:
    round_id: int


@dataclass(frozen=True)
class Rejoin:
    """Join the job again from scratch (the server no longer counts this node); `reason` "": nothing to say."""
    reason: str


@dataclass(frozen=True)
class Leave:
    """Tell the server this node goes (a courtesy: its lease lapses anyway); `unhealthy`: its host is kept out;
    `stopped`: the agent was stopped by a signal and may be started again at once (LeaveRequest.stopped), and
    `stops_workers`: it stops its workers after the leave (the job's wait counts from the end of their stop)."""
    reason: str
    unhealthy: UnhealthyKind | None = None
    stopped: bool = False
    stops_workers: bool = False


@dataclass(frozen=True)
class CheckNode:
    """Run the node's checks at `stage`; answer: NodeChecked. Stage.FAILURE checks the GPUs and
    the failures' messages only (a site script would hold up every restart)."""
    stage: Stage
    round_id: int
    failures: tuple[WorkerFailure, ...] = ()


@dataclass(frozen=True)
class AskWitnesses:
    """Ask the round's witnesses whether they are there (the server is silent); answer: WitnessesAnswered."""
    witnesses: tuple[Witness, ...]


@dataclass(frozen=True)
class Exit:
    code: int
    message: str
    root_cause: WorkerFailure | None = None   # the job's first failure, when the job failed


Action = (Spawn | StopWorkers | ReportFailure | ReportStall | ReportSuccess | Rejoin | Leave | AskWitnesses | CheckNode
          | Exit | SendNote | HoldAtSnapshot | KeepFrom)
