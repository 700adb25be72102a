"""The agent's supervision policy: given one fact and `now`, decide what to do. No I/O.
Facts (facts.py) in, actions (actions.py) out; the loop (agent.py) runs them in order and sleeps until
`next_deadline()`, so the timed rules (`_timed_rules()`) fire even when no fact comes. Rules:
- the server's view wins: a round it names that we do not run replaces ours; not a member (waiting, spare,
  excluded): run nothing;
- a local failure (exit, spawn error) stops the local group and is reported once, for its round; stalled
  ranks are reported while the round runs (the server, which hears every node, decides what is a hang);
  news about a round we no longer run changes nothing (but a worker of it that failed by itself before its
  process group is reported: the server then counts that round's failure against no node, as the script's);
  the server answers with the next round or the end;
- all local workers succeeding is reported once; we follow the server until the job ends (another node
  failing still restarts the job);
- server unreachable: workers keep running; `server_wait_s` after the first failed try (timed): stop, give up;
- fencing (timed), only on evidence (fencing.py): a node cut off from the server, whose round the server
  replaced, stops its workers and reports the round's failure;
- a refused join ends the agent (exit 0 when drained: nothing failed), except `node_conflict`: maybe our
  previous agent, not yet seen dead, so the join is retried each second for a lease and a bit;
- a refused poll: start afresh when the server forgot the job or node, else end; a refused report is
  dropped (the next poll says where things stand) unless malformed (`Refusal.INVALID`: refused again),
  which leaves the job and ends; `forbidden` (taken over) or `unauthorized` ends it, whatever the request;
- a signal stops the workers, leaves the job, and exits with 128 + signal;
- the node's own checks (node_health.py): an unhealthy node leaves (no failure reported) and checks again
  after a back-off."""
from __future__ import annotations

import enum
import signal
from collections.abc import Callable
from dataclasses import dataclass, field

from node_agent.client.replies import (
    CONFLICT_RETRY_S,
    ENDINGS,
    OTHER_ENDING,
    News,
    Path,
    Refusal,
    conflict_retry_for,
    news,
    refusal,
)
from node_agent.core.actions import (
    Action,
    AskWitnesses,
    CheckNode,
    Exit,
    HoldAtSnapshot,
    KeepFrom,
    Leave,
    Rejoin,
    ReportFailure,
    ReportStall,
    ReportSuccess,
    SendNote,
    Spawn,
    StopWorkers,
)
from node_agent.core.facts import (
    DeadlinePassed,
    Fact,
    NodeChecked,
    NoteDue,
    RanksStalled,
    ServerNotReached,
    ServerRefused,
    SignalReceived,
    SpawnFailed,
    Stage,
    StatusReceived,
    Verdict,
    WitnessesAnswered,
    WorkersExited,
)
from node_agent.core.fencing import Fence, fenced
from node_agent.core.node_health import NodeHealth
from node_agent.core.summary import job_ending
from protocol.bounds import MAX_REASON
from protocol.codec import REQUEST_TYPES
from protocol.errors import ErrorCode
from protocol.messages import Assignment, JobState, JoinRequest, NodeStatus, WorkerFailure

TimedRule = tuple[float, Callable[[float], list[Action]]]   # (when, what to do once it has come)


class Workers(enum.Enum):
    NONE = "none"            # nothing running
    RUNNING = "running"
    SUCCEEDED = "succeeded"  # all local workers exited 0; reported
    FAILED = "failed"        # a local worker failed; group stopped; reported


REQUEST_NAMES = {cls: name for name, cls in REQUEST_TYPES.items()}


@dataclass(slots=True)   # slots: a misspelt attribute is an error (mypy and at run time), not a new one
class SupervisionPolicy:
    server_wait_s: float
    lease_timeout_s: float = 5.0
    # A SIGTERM may be a restart (`systemctl restart`, a container's): its next agent can come back under this
    # node id (agent.py: given, not made from this process's pid; not the end of a Slurm step; not standalone).
    restartable: bool = False
    running_round: int = -1          # the round whose workers we run (or ran, until told otherwise)
    workers: Workers = Workers.NONE
    unreachable_since: float | None = None
    unreachable_error: str = ""      # the last try's error, for the message when we give up
    exiting: bool = False
    conflict_since: float | None = None   # when a join was first refused for a live agent holding the id
    retry_join_at: float | None = None
    assignment: Assignment | None = None  # the round we run (its witnesses, its size)
    fence: Fence = field(init=False)      # asking the witnesses while the server is silent (fencing.py)
    job_over: bool = False           # the server said the job finished (peer copies of it may go: copies/peers.py)
    ran: bool = False                # this node's workers were started in some round of the job
    health: NodeHealth = field(default_factory=NodeHealth)   # the node's own checks (node_health.py)
    holding: bool = False            # its ranks wait after their next snapshot (NodeStatus.hold_at_snapshot)
    keep_from: tuple[int, int] = (-1, -1)   # the floors its ranks keep their snapshots by (KeepFrom)

    def __post_init__(self) -> None:
        self.fence = Fence(self.lease_timeout_s)

    @property
    def known_round(self) -> int:
        """What the long-poll tells the server we run: -1 once we run nothing for a round."""
        return self.running_round

    def handle(self, fact: Fact, now: float) -> list[Action]:
        """Everything the policy knows arrives here, one fact at a time."""
        if self.exiting:
            return []   # on the way out: news no longer matters (a second signal is the shell's)
        self.health.last_now = now
        match fact:
            case StatusReceived(status=status, sent_at=sent_at):
                self.unreachable_since = self.conflict_since = None
                self.fence.heard(sent_at)
                return self._status(status)
            case WitnessesAnswered(verdict=verdict, server=server):
                return self._peers(verdict, server, now)
            case ServerRefused():
                self.unreachable_since = None
                return self._refused(fact, now)
            case ServerNotReached(error=error):
                if self.unreachable_since is None:
                    self.unreachable_since = now
                self.unreachable_error = error
                return self._due(now)
            case WorkersExited(round_id=round_id, failures=()):
                return self._succeeded(round_id)
            case WorkersExited(round_id=round_id, failures=failures):
                return self._failed(round_id, failures)
            case RanksStalled(round_id=round_id, threshold_s=threshold_s, ranks=ranks):
                # Ranks asked to wait after their snapshot (a swap: at most SWAP_WAIT_S) are no stall.
                running = self.workers == Workers.RUNNING and round_id == self.running_round and not self.holding
                return [ReportStall(round_id, threshold_s, ranks)] if running else []
            case NoteDue(round_id=round_id):
                return [SendNote()] if self.workers == Workers.RUNNING and round_id == self.running_round else []
            case SpawnFailed(round_id=round_id, failure=failure):
                return self._failed(round_id, (failure,))
            case SignalReceived(signum=signum):
                return self._signalled(signum)
            case NodeChecked():
                return self._checked(fact, now)
            case DeadlinePassed():
                return self._due(now)
        raise TypeError(f"not a fact: {fact!r}")

    def next_deadline(self) -> float | None:
        """When the earliest timed rule fires unless a fact comes first (None: no rule is armed)."""
        return min((when for when, _ in self._timed_rules()), default=None)

    def _timed_rules(self) -> list[TimedRule]:
        """The armed rules, in the order they win when several are due (none once exiting)."""
        if self.exiting:
            return []
        give_up = None if self.unreachable_since is None else self.unreachable_since + self.server_wait_s
        check = self.health.due(self.running_round if self.workers == Workers.RUNNING else None)
        rules: list[tuple[float | None, Callable[[float], list[Action]]]] = [
            (give_up, self._give_up),
            (self.retry_join_at, self._retry_join),
            (self._fence_at(), self._ask_witnesses),
            (check, lambda now: self.health.periodic(self.running_round)),
            (self.health.retry_at, self._retry_health),
        ]
        return [(when, rule) for when, rule in rules if when is not None]

    def _fence_at(self) -> float | None:
        """When to ask the witnesses whether this node is the one cut off (None: no need)."""
        a = self.assignment
        if self.workers != Workers.RUNNING or self.unreachable_since is None \
                or a is None or a.group_world_size < 2:     # alone in its round: nobody to split from
            return None
        return self.fence.ask_at(self.unreachable_since)

    @property
    def in_contact(self) -> bool:
        """Whether this agent hears the server (what it tells the other agents that ask: witness.py)."""
        return self.unreachable_since is None

    def _ask_witnesses(self, now: float) -> list[Action]:
        assert self.assignment is not None    # a server that names no witness: the server check alone
        self.fence.asked()
        return [AskWitnesses(self.assignment.witnesses)]

    def _peers(self, verdict: Verdict, server: Path | None, now: float) -> list[Action]:
        running = self.workers == Workers.RUNNING and self.assignment is not None
        since = self.unreachable_since if running else None       # moot once the workers ended
        if not self.fence.answered(verdict, server, since, now):
            return []
        assert self.assignment is not None and self.unreachable_since is not None
        self.workers = Workers.FAILED
        silent = self.fence.silent_for(self.unreachable_since, now)
        why, failure = fenced(verdict, silent, self.lease_timeout_s, self.assignment.rank_offset)
        return [StopWorkers(why), ReportFailure(self.running_round, (failure,))]

    def _retry_join(self, now: float) -> list[Action]:
        self.retry_join_at = None
        return [Rejoin("this node id is still held by a live agent; trying again")]

    def _due(self, now: float) -> list[Action]:
        for when, rule in self._timed_rules():
            if now >= when:
                return rule(now)
        return []

    def _give_up(self, now: float) -> list[Action]:
        assert self.unreachable_since is not None
        return self._end(1, "rendezvous server unreachable",
                         f"rendezvous server unreachable for {now - self.unreachable_since:.0f}s "
                         f"(limit {self.server_wait_s:g}s): {self.unreachable_error}")

    def _status(self, status: NodeStatus) -> list[Action]:
        if self.health.out and not status.job_state.finished:
            return []      # left as unhealthy: a late answer from before is no news until the next check
        actions = self.health.readmit(status.checks_due) + self._news(status)
        hold = status.hold_at_snapshot and self.workers == Workers.RUNNING and status.round_id == self.running_round
        if hold != self.holding:
            self.holding = hold
            actions.append(HoldAtSnapshot(hold))
        member = status.assignment is not None          # (a member's news)
        floors = (status.copies_floor, status.held_floor) if member else (-1, -1)
        if floors != self.keep_from:
            self.keep_from = floors
            actions.append(KeepFrom(*floors))
        return actions

    def _news(self, status: NodeStatus) -> list[Action]:
        match news(status, self.running_round):
            case News.FINISHED:
                return self._finish(status)
            case News.REJOIN:
                # The reason is the job's latest news (maybe about another node): said as the job's.
                why = f" (job {status.job_id}: {status.reason})" if status.reason else ""
                return self._drop_round("the server no longer counts this node") + [
                    Rejoin(f"the server no longer counts this node{why}")]
            case News.NEW_ROUND:
                a = status.assignment
                assert a is not None
                actions = self._stop(f"round {a.round_id} replaces round {self.running_round}",
                                     finish_writes=status.writes_end_round == self.running_round)
                restart, self.ran = self.ran, True
                self.running_round, self.workers, self.assignment = a.round_id, Workers.RUNNING, a
                return actions + self.health.spawn(a, restart)
            case News.NOT_MEMBER if self.running_round != -1:   # waiting, spare or excluded: run nothing
                return self._drop_round(f"node is {status.node_state.value}: {status.reason}",
                                        finish_writes=status.writes_end_round == self.running_round)
        return []

    def _refused(self, fact: ServerRefused, now: float) -> list[Action]:
        if fact.code is ErrorCode.HOST_UNHEALTHY and fact.request is JoinRequest:
            self.health.failed(Stage.JOIN, now, fact.message)    # held out by the server: ask again later
            return []
        meaning = refusal(fact.code, fact.request)
        match meaning:
            case Refusal.CONFLICT:
                # Maybe our own predecessor, dead but not yet noticed: wait out its lease, then give up.
                if self.conflict_since is None:
                    self.conflict_since = now
                if now - self.conflict_since < conflict_retry_for(self.lease_timeout_s):
                    self.retry_join_at = now + CONFLICT_RETRY_S
                    return []
            case Refusal.INVALID:      # refused again if sent again: leave, so the others go on without us
                name = f"{REQUEST_NAMES[fact.request]} request"
                actions = self._stop(f"the server refused this node's {name}")
                self.exiting = True
                return actions + [Leave(f"the server refused this node's {name}: {fact.message}"[:MAX_REASON]),
                                  Exit(1, f"the rendezvous server refused this node's {name}, and would again: "
                                          f"{fact.message}")]
            case Refusal.DROPPED:
                return []      # a refused report: the next poll says where things stand
            case Refusal.FORGOTTEN:
                # The server forgot the job or node (it restarted without its state): start afresh.
                return self._drop_round(f"the server no longer knows this {fact.code.value.split('_')[1]}") + [
                    Rejoin(fact.message)]
        code, stop, say = ENDINGS.get(meaning, OTHER_ENDING)
        return self._end(code, stop, say.format(fact.message))

    def _end(self, code: int, stop_reason: str, message: str, root_cause: WorkerFailure | None = None) -> list[Action]:
        self.exiting = True
        return self._stop(stop_reason) + [Exit(code, message, root_cause)]

    def _failed(self, round_id: int, failures: tuple[WorkerFailure, ...]) -> list[Action]:
        if self.workers != Workers.RUNNING or round_id != self.running_round:
            # A round another node's failure ended while ours failed on their own too (reports.py: blame.shared)
            own = tuple(f for f in failures if f.before_group)
            told = self.workers == Workers.FAILED and round_id == self.running_round     # reported already
            return [ReportFailure(round_id, own)] if own and not (told or self.job_over or self.exiting) else []
        self.workers = Workers.FAILED
        stop = StopWorkers(f"local rank {failures[0].local_rank} failed")
        if self.health.enabled:     # a broken GPU makes the node leave instead of counting a restart
            return [stop, CheckNode(Stage.FAILURE, round_id, failures)]
        return [stop, ReportFailure(round_id, failures)]

    def _checked(self, fact: NodeChecked, now: float) -> list[Action]:
        if fact.problem is None:
            was_out = self.health.out_since is not None
            self.health.passed(fact.stage, now)
            if fact.stage == Stage.FAILURE:
                return [ReportFailure(fact.round_id, fact.failures)]
            if fact.stage == Stage.READMIT:
                self.health.readmit_passed = True
                return [SendNote()]      # the server hears it now, not at the next held poll's end
            if fact.stage == Stage.JOIN:        # said only where a check had kept it out: a first join is no news
                return [Rejoin("the node's checks passed" if was_out else "")]
            a = self.health.take_pending(fact.round_id) if fact.stage == Stage.RESTART \
                and fact.round_id == self.running_round else None
            return [Spawn(a)] if a is not None and self.workers == Workers.RUNNING else []
        if self.health.out or (fact.stage == Stage.RUNNING and fact.round_id != self.running_round):
            self.health.answered(fact.stage)
            return []      # already out, or about a round since replaced (its own check comes)
        # Told when it leaves a round, and once when it does not join; not at every check while out.
        tell = fact.stage != Stage.JOIN or self.health.out_since is None
        self.health.failed(fact.stage, now, fact.problem)
        return self._drop_round(f"node unhealthy: {fact.problem}") + (
            [Leave(f"unhealthy: {fact.problem}"[:MAX_REASON], fact.kind)] if tell else [])

    def _retry_health(self, now: float) -> list[Action]:
        h = self.health
        if h.out_since is not None and now - h.out_since >= h.give_up_s:
            return self._end(1, "node unhealthy", f"this node stayed unhealthy for {now - h.out_since:.0f}s (the "
                                                  f"job's join timeout {h.give_up_s:g}s): {h.problem}")
        return h.retry()

    def _succeeded(self, round_id: int) -> list[Action]:
        if self.workers != Workers.RUNNING or round_id != self.running_round:
            return []
        self.workers = Workers.SUCCEEDED
        return [ReportSuccess(round_id)]

    def _signalled(self, signum: int) -> list[Action]:
        name = signal.Signals(signum).name
        self.exiting = True
        stopped = self.restartable and signum == signal.SIGTERM      # what a service manager stops with
        stop, end = self._stop(f"agent received {name}", signum, finish_writes=True), \
            Exit(128 + signum, f"node-agent stopped by {name}")
        # (a restart waiting for its check has spawned nothing yet)
        spawned = bool(stop) and self.health.pending is None
        leave = Leave(f"agent received {name}", stopped=stopped, stops_workers=stopped and spawned)
        # said first when stopped: a second signal, or the manager's SIGKILL when its grace ends, may cut the stop short
        return [leave, *stop, end] if stopped else [*stop, leave, end]

    def _stop(self, reason: str, signum: int = signal.SIGTERM, finish_writes: bool = False) -> list[Action]:
        running, self.workers = self.workers == Workers.RUNNING, Workers.NONE
        return [StopWorkers(reason, signum, finish_writes)] if running else []

    def _drop_round(self, reason: str, finish_writes: bool = False) -> list[Action]:
        """Stop the workers and run no round until the server names one (`finish_writes`: a member's leave ended
        the round, no failure: their snapshot writes under way end first, NodeStatus.writes_end_round)."""
        self.running_round = -1
        return self._stop(reason, finish_writes=finish_writes)

    def _finish(self, status: NodeStatus) -> list[Action]:
        self.job_over = True
        code, stop, message = job_ending(status, self.ran)
        return self._end(code, stop, message, status.root_cause if status.job_state == JobState.FAILED else None)
