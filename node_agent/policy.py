"""The agent's supervision policy: given what happened and `now`, decide what to do. No I/O.

Facts come in (the server's status, local workers failing or finishing, the server being
unreachable, a signal) and actions come out (`Spawn`, `StopWorkers`, `ReportFailure`,
`ReportSuccess`, `Rejoin`, `Leave`, `Exit`). The loop in `agent.py` executes them in order.

Rules:
- the server's view wins: when it names a round we do not run, stop ours and spawn that one;
  when we are not a member (waiting, spare, excluded), run nothing;
- a local failure stops the local group and is reported once for the round it happened in;
  the server then answers with the next round (or the job's end);
- all local workers succeeding is reported once; we keep following the server until the job ends
  (another node failing still means a job-wide restart);
- the server being unreachable leaves workers running; past `server_wait_s` we give up;
- a signal stops the workers, leaves the job, and exits with 128 + signal.
"""
from __future__ import annotations

import enum
import signal as _signal
from dataclasses import dataclass

from protocol.messages import Assignment, JobState, NodeState, NodeStatus, WorkerFailure


@dataclass(frozen=True)
class Spawn:
    assignment: Assignment


@dataclass(frozen=True)
class StopWorkers:
    reason: str
    signum: int = _signal.SIGTERM


@dataclass(frozen=True)
class ReportFailure:
    round_id: int
    failures: tuple[WorkerFailure, ...]


@dataclass(frozen=True)
class ReportSuccess:
    round_id: int


@dataclass(frozen=True)
class Rejoin:
    reason: str


@dataclass(frozen=True)
class Leave:
    reason: str


@dataclass(frozen=True)
class Exit:
    code: int
    message: str


Action = Spawn | StopWorkers | ReportFailure | ReportSuccess | Rejoin | Leave | Exit


class Workers(enum.Enum):
    NONE = "none"            # nothing running
    RUNNING = "running"
    SUCCEEDED = "succeeded"  # all local workers exited 0; reported
    FAILED = "failed"        # a local worker failed; group stopped; reported


@dataclass
class SupervisionPolicy:
    server_wait_s: float
    running_round: int = -1          # the round whose workers we run (or ran, until told otherwise)
    workers: Workers = Workers.NONE
    unreachable_since: float | None = None
    exiting: bool = False

    @property
    def known_round(self) -> int:
        """What the long-poll tells the server we run: -1 once we run nothing for a round."""
        return self.running_round

    def on_status(self, status: NodeStatus, now: float) -> list[Action]:
        self.unreachable_since = None
        if self.exiting:
            return []
        actions: list[Action] = []
        if status.job_state.finished:
            return self._finish(status)
        if status.node_state == NodeState.GONE:
            actions += self._stop(f"the server no longer counts this node ({status.reason or 'lease lost'})")
            self.running_round = -1
            return actions + [Rejoin(status.reason or "node no longer part of the job")]
        if status.node_state == NodeState.MEMBER and status.assignment is not None:
            a = status.assignment
            if a.round_id != self.running_round:
                actions += self._stop(f"round {a.round_id} replaces round {self.running_round}")
                self.running_round = a.round_id
                self.workers = Workers.RUNNING
                actions.append(Spawn(a))
            return actions
        # waiting, spare or excluded: run nothing
        if self.running_round != -1:
            actions += self._stop(f"node is {status.node_state.value}: {status.reason}")
            self.running_round = -1
        return actions

    def on_rejected(self, code: str, message: str, now: float) -> list[Action]:
        """The server refused a poll. It forgot the job or node (it restarted): start afresh."""
        if self.exiting:
            return []
        self.unreachable_since = None
        if code in ("unknown_job", "unknown_node"):
            actions = self._stop(f"the server no longer knows this {code.split('_')[1]}")
            self.running_round = -1
            return actions + [Rejoin(message)]
        self.exiting = True
        return self._stop("the server refused this agent") + [Exit(1, f"the server refused this agent: {message}")]

    def on_drained(self, message: str) -> list[Action]:
        """An operator drained this node: stop anything running and exit 0 (nothing failed here)."""
        self.exiting = True
        return self._stop("node drained by the operator") + [Exit(0, message)]

    def on_workers_failed(self, failures: list[WorkerFailure], now: float) -> list[Action]:
        if self.exiting or self.workers != Workers.RUNNING:
            return []
        self.workers = Workers.FAILED
        first = failures[0]
        return [StopWorkers(f"local rank {first.local_rank} failed"),
                ReportFailure(self.running_round, tuple(failures))]

    def on_workers_succeeded(self, now: float) -> list[Action]:
        if self.exiting or self.workers != Workers.RUNNING:
            return []
        self.workers = Workers.SUCCEEDED
        return [ReportSuccess(self.running_round)]

    def on_server_unreachable(self, error: str, now: float) -> list[Action]:
        if self.exiting:
            return []
        if self.unreachable_since is None:
            self.unreachable_since = now
        if now - self.unreachable_since < self.server_wait_s:
            return []
        self.exiting = True
        return self._stop("rendezvous server unreachable") + [
            Exit(1, f"rendezvous server unreachable for {now - self.unreachable_since:.0f}s "
                    f"(limit {self.server_wait_s:g}s): {error}")]

    def on_signal(self, signum: int, now: float) -> list[Action]:
        name = _signal.Signals(signum).name
        if self.exiting:
            return []
        self.exiting = True
        return self._stop(f"agent received {name}", signum) + [
            Leave(f"agent received {name}"), Exit(128 + signum, f"node-agent stopped by {name}")]

    def _stop(self, reason: str, signum: int = _signal.SIGTERM) -> list[Action]:
        if self.workers == Workers.RUNNING:
            self.workers = Workers.NONE
            return [StopWorkers(reason, signum)]
        self.workers = Workers.NONE
        return []

    def _finish(self, status: NodeStatus) -> list[Action]:
        self.exiting = True
        actions = self._stop(f"job {status.job_state.value}")
        if status.job_state == JobState.SUCCEEDED:
            return actions + [Exit(0, f"job {status.job_id} succeeded: {status.reason}")]
        if status.job_state == JobState.FAILED:
            return actions + [Exit(1, failure_summary(status))]
        return actions + [Exit(1, f"job {status.job_id} {status.job_state.value}: {status.reason}")]


def failure_summary(status: NodeStatus) -> str:
    lines = [f"job {status.job_id} failed: {status.reason}"]
    rc = status.root_cause
    if rc is not None:
        how = f"signal {rc.signal}" if rc.signal else f"exit code {rc.exitcode}"
        lines.append("root cause (first failure in time across all nodes):")
        lines.append(f"  host      : {rc.host} (node {rc.node_id})")
        lines.append(f"  rank      : {rc.rank} (local rank {rc.local_rank})")
        lines.append(f"  failure   : {rc.reason}, {how}")
        if rc.message:
            lines.append(f"  error     : {rc.message}")
        if rc.traceback:
            lines.append("  traceback :")
            lines.extend("    " + ln for ln in rc.traceback.rstrip().splitlines())
    return "\n".join(lines)
