"""The agent's own console lines, `[node-agent NODE] ...`, all worded here: each fact with the actions it
led to, then each action as it runs. Worker output never comes through here (output.py prefixes it)."""
from __future__ import annotations

import re
import signal
import time
from typing import TextIO

from node_agent.client.replies import Path
from node_agent.client.retry import unreachable_line
from node_agent.core.actions import Action, Exit, Rejoin, Spawn, StopWorkers
from node_agent.core.facts import (
    Fact,
    NodeChecked,
    RanksStalled,
    ServerNotReached,
    ServerRefused,
    SpawnFailed,
    Stage,
    StatusReceived,
    Verdict,
    WitnessesAnswered,
    WorkersExited,
)
from node_agent.core.summary import how
from node_agent.settings import AgentSettings, Mode, StdSpec
from node_agent.workers.console import agent_console, set_label
from protocol.errors import ErrorCode
from protocol.messages import (
    Assignment,
    FailureReason,
    FailureReport,
    JoinRequest,
    NodeState,
    NodeStatus,
    SuccessReport,
    WorkerFailure,
)
from protocol.stalls import RankSeen, RankState

# What the witnesses said that keeps the workers running while the server is silent: said once per outage.
GOING_ON = {
    Verdict.STILL_MEMBER: "the round's other nodes still hear the server, in this node's round: nothing was "
                          "replaced, so the workers keep running while this node's own path comes back",
    Verdict.SERVER_AWAY: "the server does not answer, nor does it answer the round's other nodes: the server itself "
                         "is away, so the workers keep running",
    Verdict.UNANSWERED: "the server does not answer; the round's other nodes take a connection but do not answer "
                        "(busy, or their port flooded): this node is not cut off, so the workers keep running",
}


class Narrator:
    def __init__(self, node_id: str, console: TextIO | None = None, addr: str = "", *, server: str = "",
                 server_wait_s: float = 0.0) -> None:
        self.node_id = node_id
        self.console = console
        if console is None:
            set_label(f"node-agent {node_id}")   # how the console's notices of dropped lines start
        self.addr = addr                   # the address this node advertises
        self.server = server               # the rdzv-server, as HOST:PORT ("" when there is none)
        self.server_wait_s = server_wait_s
        self._last_view: tuple[NodeState, int, int] | None = None
        self._said_master = False
        self._rejoin_said = ""         # the rejoin last said: a join retried for the same reason is said once
        self._said_peers = False
        self._said_unreachable = False     # said once per outage, at its first failed try
        self._said_stall: tuple[str, float] = ("", 0.0)   # the server's stall line last said (its shape), and when

    def say(self, message: str) -> None:
        text = "".join(f"[node-agent {self.node_id}] {line}\n" for line in message.splitlines() or [""])
        if self.console is not None:      # a test's stream
            self.console.write(text)
            self.console.flush()
        else:                             # the agent's stderr, which never blocks (node_agent/workers/console.py)
            agent_console("stderr").write(text)

    def fact(self, fact: Fact, actions: list[Action]) -> None:
        """What happened, said before the actions it led to run (failures only when they count)."""
        match fact:
            case StatusReceived(status=status):
                if self._said_unreachable:
                    self.say(f"the rdzv-server at {self.server} answers again")
                self._said_peers = self._said_unreachable = False   # a next outage is told anew
                self._describe(status)
            case ServerNotReached(error=error) if not self._said_unreachable and self.server:
                self._said_unreachable = True
                self.say(unreachable_line(self.server, self.server_wait_s, error))
            case ServerRefused(request=request, message=message) if request in (FailureReport, SuccessReport):
                self.say(f"server rejected the report: {message}")
            case WorkersExited(failures=(first, *_)) if actions:
                what = first.message if first.reason == FailureReason.EXITED_EARLY else f"failed with {how(first)}"
                # the store host is reported as local rank 0 (the protocol's fields), but no worker died
                said = first.message if first.reason == FailureReason.STORE_EXITED else f"{worker(first)} {what}"
                self.say(f"{said}; stopping local workers")
            case RanksStalled(first=True, threshold_s=threshold_s, ranks=ranks) if actions:
                self.say(stall_lines(ranks, threshold_s))
            case SpawnFailed(failure=failure) if actions:
                self.say(f"{worker(failure)} did not start: {failure.message}")
            case NodeChecked(stage=Stage.JOIN, problem=str(problem)):
                self.say(f"not joining: this node is unhealthy: {problem}; checking again after a back-off")
            case NodeChecked(stage=stage, problem=str(problem)) if actions:
                self.say(f"node unhealthy ({stage.value}): {problem}; leaving the job (no restart is counted) and "
                         f"checking again after a back-off")
            case ServerRefused(request=request, code=ErrorCode.HOST_UNHEALTHY, message=message) \
                    if request is JoinRequest:
                self.say(f"the server keeps this host out: {message}; asking again after a back-off")
            case WitnessesAnswered() if actions and isinstance(actions[0], StopWorkers):
                self.say(actions[0].reason)
            case WitnessesAnswered(server=Path.STANDBY) if not self._said_peers:
                self._said_peers = True
                self.say("the server's replicas answer but none serves yet (a takeover or restart is under way): "
                         "the workers keep running")
            case WitnessesAnswered(verdict=verdict) if verdict in GOING_ON and not self._said_peers:
                self._said_peers = True
                self.say(GOING_ON[verdict])

    def action(self, action: Action) -> None:
        """What the agent does, said as it starts doing it."""
        match action:
            case Spawn(assignment=a):
                self._rejoin_said = ""
                self.say(round_line(a))
                if a.group_rank == 0 and a.master_addr != self.addr and not self._said_master and self.addr:
                    self._said_master = True
                    self.say(f"this node advertises {self.addr}, which the other hosts cannot reach (a loopback "
                             f"address: it reached the server by loopback); the server gives them MASTER_ADDR "
                             f"{a.master_addr} instead. Start this agent with --local-addr ADDR to choose it.")
            case Rejoin(reason=reason) if reason and reason != self._rejoin_said:
                self._rejoin_said = reason
                self.say(f"rejoining: {reason}")
            case Exit(message=message):
                self.say(message)

    def forced_exit(self, signum: int) -> None:
        self.say(f"second {signal.Signals(signum).name}: forced exit")

    def _describe(self, status: NodeStatus) -> None:
        """Say once when this node starts waiting, becomes a spare or is excluded; the server's view of a stall when
        it changes, and every STALL_EVERY_S while it lasts."""
        if status.stall:
            shape, now = _SECONDS.sub("for _s", status.stall), time.monotonic()
            if shape != self._said_stall[0] or now - self._said_stall[1] >= STALL_EVERY_S:
                self._said_stall = (shape, now)
                self.say(f"the server sees: {status.stall}")
        view = (status.node_state, status.spare_position, status.round_id)
        if view == self._last_view:
            return
        self._last_view = view
        # The status's reason is the job's latest news, not necessarily about this node: say whose it is.
        news = f" (job {status.job_id}: {status.reason})" if status.reason else ""
        if status.node_state == NodeState.SPARE:
            self.say(f"job is at max nodes: waiting as spare #{status.spare_position + 1}{news}")
        elif status.node_state == NodeState.EXCLUDED:
            self.say(f"this node is excluded for {status.excluded_for_s:.0f}s more{news}")
        elif status.node_state == NodeState.WAITING:
            self.say(f"waiting for the next round{news or ': collecting nodes'}")


def round_line(a: Assignment) -> str:
    return (f"round {a.round_id}: group rank {a.group_rank}/{a.group_world_size}, ranks "
            f"{a.rank_offset}..{a.rank_offset + a.local_world_size - 1} of world size {a.world_size}, "
            f"master {a.master_addr}:{a.master_port}, restart count {a.restart_count}/{a.max_restarts}")


STALL_EVERY_S = 60.0     # a stall the server shows is said again this often while it lasts
_SECONDS = re.compile(r"for \d+s")
STACK_LINES = 8     # of each rank's stack, on the console (the whole one goes with the report to the server)


def stall_lines(ranks: tuple[RankSeen, ...], threshold_s: float) -> str:
    """A stall, rank by rank, with each one's innermost frames (the server decides whether it is a hang)."""
    lines = [f"ranks stopped stepping for {threshold_s:.1f}s or more; what each is doing (the server decides "
             f"whether the job hangs):"]
    for r in ranks:
        cpu = f", cpu {r.cpu:.0%}" if r.state != RankState.EXITED else ""
        lines.append(f"  rank {r.rank} (local {r.local_rank}): {r.state.value}{cpu}, {r.steps} steps, "
                     f"last {r.stalled_s:.1f}s ago{f' at {r.where}' if r.where else ''}")
        lines += [f"      {frame}" for frame in r.stack.splitlines()[:STACK_LINES]]
    return "\n".join(lines)


def worker(f: WorkerFailure) -> str:
    return f"worker rank {f.rank} (local {f.local_rank})"


def start_lines(settings: AgentSettings) -> list[str]:
    """What the agent says before it starts: a job id it chose, and what a static launch means."""
    lines = []
    link, workers = settings.link, settings.workers
    if link.job_id_source:
        lines.append(f"job id {link.job_id} (from {link.job_id_source}; --rdzv-id sets another)")
    if workers.log_dir is None and (workers.redirects != StdSpec() or workers.tee != StdSpec()):
        lines.append(f"worker logs go to {workers.run_dir} (a temporary directory: no --log-dir)")
    if link.mode is Mode.STATIC:
        lines.append(f"static launch: node rank {link.node_rank} of {link.job.max_nodes}, master "
                     f"{link.master_addr}:{link.master_port}; no rendezvous server, so restarts are this "
                     f"node's own (as with torchrun's static backend)")
    return lines


def reply_of(end: Exit | None, code: int) -> tuple[str, str, float, int | None]:
    """(message, traceback, unix time, error code) for TORCHELASTIC_ERROR_FILE: a failed job's root cause (as
    torch's launcher copies its first failed worker's, exit code as errorCode), else why this agent stopped."""
    if end is not None and (rc := end.root_cause) is not None:
        message = rc.message or f"{worker(rc)} on {rc.host or rc.node_id} failed with {how(rc)}"
        return message, rc.traceback, rc.timestamp or time.time(), rc.exitcode
    if end is not None:
        return end.message, "", time.time(), None
    return f"node-agent exited with status {code}", "", time.time(), None
