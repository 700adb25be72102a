"""When the agent checks its own node, and what an answer means. Pure: `now` comes in, no I/O.
The checks run in the shell (node_checks.py), which answers each `CheckNode` with a `NodeChecked`. Rules:
- checks on (NVIDIA GPUs, or --health-check): join only after a check passes; a restart here (a new round
  after this node's workers ran) spawns only after a check; a check every `interval_s` while workers run;
  a worker failure is checked (its GPUs, a GPU fault in its message) before it is reported;
- a suspect node (the server's NodeStatus.checks_due) checks once more before it may take a place again;
- unhealthy (at any of these, or a worker outlived SIGKILL, checks on or not): do not join, or leave the
  round saying why and of what kind. No failure is reported, so no restart counts against the job, and
  the server re-forms the round as for a lost node. Check again after a back-off (RETRY_MIN_S, or the
  check interval when shorter, doubling to RETRY_MAX_S) and join once healthy, so a node repaired in place
  comes back; server news meanwhile is old news, except the job's end. Out longer than `give_up_s` (the job's
  join timeout): exit 1 with the last finding, since a node that is out never learns of the job's end."""
from __future__ import annotations

from dataclasses import dataclass

from node_agent.core.actions import Action, CheckNode, Spawn
from node_agent.core.facts import Stage
from protocol.messages import Assignment

RETRY_MIN_S = 5.0
RETRY_MAX_S = 300.0


@dataclass(slots=True)
class NodeHealth:
    enabled: bool = False                 # checks on (otherwise only a stuck worker takes the node out)
    interval_s: float = 5.0
    last_now: float = 0.0                 # the policy's latest `now` (arms the periodic check at a spawn)
    next_check_at: float | None = None    # while workers run
    checking: bool = False                # a periodic check is in flight
    retry_at: float | None = None         # found unhealthy: out of the job until this check
    unhealthy_in_row: int = 0
    pending: Assignment | None = None     # a restart waiting for its check
    retry_min_s: float = RETRY_MIN_S
    give_up_s: float = 600.0              # out this long without passing a check: the agent ends
    out_since: float | None = None
    problem: str = ""                     # the last finding that kept the node out
    # A suspect node (NodeStatus.checks_due): its check asked for, then passed (said on every poll until the
    # server stops asking).
    readmit_asked: bool = False
    readmit_passed: bool = False

    def readmit(self, due: bool) -> list[Action]:
        """The server's word on whether this node's checks are due before it takes a place again."""
        if not due:
            self.readmit_asked = self.readmit_passed = False
            return []
        if self.readmit_asked:
            return []
        self.readmit_asked = True
        return [CheckNode(Stage.READMIT, -1)]

    @property
    def out(self) -> bool:
        """The node left (or did not join) as unhealthy and waits for its next check."""
        return self.retry_at is not None

    def spawn(self, a: Assignment, restart: bool) -> list[Action]:
        """What to do with a new round: spawn it, or check first when it restarts this node's workers."""
        if self.enabled and restart:
            self.pending, self.next_check_at = a, None
            return [CheckNode(Stage.RESTART, a.round_id)]
        self.pending = None
        self.next_check_at = self.last_now + self.interval_s if self.enabled else None
        return [Spawn(a)]

    def due(self, running_round: int | None) -> float | None:
        """When the periodic check is due (None: not while nothing runs, or one is in flight)."""
        if not self.enabled or running_round is None or self.checking:
            return None
        return self.next_check_at

    def periodic(self, running_round: int) -> list[Action]:
        self.checking, self.next_check_at = True, None
        return [CheckNode(Stage.RUNNING, running_round)]

    def passed(self, stage: Stage, now: float) -> None:
        self.unhealthy_in_row, self.out_since = 0, None
        if stage == Stage.RUNNING:
            self.checking = False
            self.next_check_at = now + self.interval_s

    def answered(self, stage: Stage) -> None:
        """A finding that changes nothing (the node is out, or its round was replaced): a periodic check is no
        longer in flight, so the next is armed as usual (else none would run again while the agent lives)."""
        if stage == Stage.RUNNING:
            self.checking = False

    def failed(self, stage: Stage, now: float, problem: str) -> None:
        """Found unhealthy: out until the next check, after a back-off doubling with each finding in a row."""
        self.problem = problem
        if self.out_since is None:
            self.out_since = now
        if stage == Stage.RUNNING:
            self.checking = False
        delay = min(RETRY_MAX_S, self.retry_min_s * 2.0 ** min(self.unhealthy_in_row, 16))
        self.unhealthy_in_row += 1
        self.retry_at, self.pending, self.next_check_at = now + delay, None, None

    def retry(self) -> list[Action]:
        """The back-off is over: check again (and join when it passes)."""
        self.retry_at = None
        return [CheckNode(Stage.JOIN, -1)]

    def take_pending(self, round_id: int) -> Assignment | None:
        """The restart of `round_id`, whose check passed, if it still waits; arms the periodic check."""
        a = self.pending
        if a is None or a.round_id != round_id:
            return None             # an answer about a round since replaced: its own check comes
        self.pending, self.next_check_at = None, self.last_now + self.interval_s
        return a
