"""The whole agent loop in one process: the real Agent and the real coordinator (through LocalClient,
no HTTP), with a scripted worker group in place of processes. The test decides when workers end, fail,
hang or cannot start, when signals come and when the server goes away; it awaits what the agent does.
"""
from __future__ import annotations

import asyncio
import io
import os
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest

from node_agent.agent import Agent
from node_agent.client.local import LocalClient
from node_agent.client.transport import ServerUnreachable
from node_agent.core.actions import Action
from node_agent.core.facts import DeadlinePassed, Fact, RanksStalled, ServerNotReached, ServerRefused, StatusReceived
from node_agent.core.policy import SupervisionPolicy
from node_agent.settings import Mode
from node_agent.workers.launch import WorkerLaunch
from node_agent.workers.process import WorkerExit, WorkerSpawnError
from protocol.errors import ErrorCode
from protocol.messages import JobConfig, NodeStatus, PollRequest
from protocol.stalls import RankSeen, RankState
from rdzv_server.coordinator import Coordinator
from tests.unit.agent_fakes import LIMIT, FakeGroup, agent_settings


class ScriptedServer(LocalClient):
    """The in-process server, recording every request, which the test can take away or restart."""

    def __init__(self, job_id: str, node_id: str) -> None:
        super().__init__(job_id, node_id)
        self.sent: list[str] = []
        self.down = False
        self._told_down = False

    async def _send(self, action: str, message: object, timeout: float) -> NodeStatus:
        self.sent.append(action)
        if self.down:
            if not self._told_down:
                self._told_down = True
                raise ServerUnreachable("connection refused")
            await asyncio.Event().wait()   # later tries never answer: only the agent's timer can end this
        return await super()._send(action, message, timeout)

    async def restart_without_state(self) -> None:
        """What a server restarted without its state store looks like: it forgot every job."""
        old, self.coordinator = self.coordinator, Coordinator()
        await old.stop()
        await self.coordinator.start()


@dataclass
class RecordingPolicy(SupervisionPolicy):
    """The agent's own policy, noting every fact it is given."""
    seen: list[Fact] = field(default_factory=list)

    def handle(self, fact: Fact, now: float) -> list[Action]:
        self.seen.append(fact)
        return super().handle(fact, now)


@dataclass
class Run:
    """One agent running in this process, and what the test sees of it."""
    agent: Agent
    server: ScriptedServer
    console: io.StringIO
    groups: asyncio.Queue[FakeGroup]
    task: asyncio.Task[int]
    facts: list[Fact] = field(default_factory=list)
    spawn_errors: list[OSError] = field(default_factory=list)

    async def next_group(self) -> FakeGroup:
        return await asyncio.wait_for(self.groups.get(), LIMIT)

    async def exit_code(self) -> int:
        return await asyncio.wait_for(self.task, LIMIT)

    def lines(self) -> list[str]:
        return self.console.getvalue().splitlines()


@pytest.fixture
async def start(tmp_path) -> AsyncIterator[Callable[..., Run]]:
    runs: list[Run] = []

    def start_agent(*, nproc: int = 2, server_wait: float = 60.0,
                    group_type: type[FakeGroup] = FakeGroup, **job: object) -> Run:
        config = JobConfig(**{"last_call_s": 0.0, **job})  # type: ignore[arg-type]
        opts = agent_settings(script="train.py", nproc=nproc, job_id="j1", job=config, node_id="n1",
                            mode=Mode.STANDALONE, log_dir=str(tmp_path), server_wait=server_wait,
                            stop_timeout=1.0)
        server = ScriptedServer(opts.workers.job_id, opts.workers.node_id)
        groups: asyncio.Queue[FakeGroup] = asyncio.Queue()
        console = io.StringIO()
        errors: list[OSError] = []

        def make_group(launches: list[WorkerLaunch], *, stop_timeout: float) -> FakeGroup:
            group = group_type(launches, stop_timeout=stop_timeout,
                              spawn_error=errors.pop(0) if errors else None)
            groups.put_nowait(group)
            return group

        agent = Agent(opts, server, "127.0.0.1", console, make_group=make_group)
        facts: list[Fact] = []
        agent.policy = RecordingPolicy(server_wait_s=agent.policy.server_wait_s, seen=facts)
        run = Run(agent, server, console, groups, asyncio.create_task(agent.run()), facts, errors)
        runs.append(run)
        return run

    yield start_agent
    for run in runs:   # a failed test must not leave an agent running
        run.task.cancel()
        await asyncio.gather(run.task, return_exceptions=True)


async def test_a_failure_is_reported_and_the_next_round_runs_to_success(start) -> None:
    run = start(max_restarts=1)
    first = await run.next_group()
    assert (first.env["RANK"], first.env["TORCHELASTIC_RESTART_COUNT"], first.env["WORLD_SIZE"]) == ("0", "0", "2")
    first.end(r0=0, r1=3)
    second = await run.next_group()
    assert first.stopped_with == signal.SIGTERM                  # stopped before the next round started
    assert second.env["TORCHELASTIC_RESTART_COUNT"] == "1"
    second.end(r0=0, r1=0)
    assert await run.exit_code() == 0
    assert run.server.sent[0] == "join" and run.server.sent.count("failure") == 1
    assert run.server.sent.count("success") == 1 and "leave" not in run.server.sent
    lines = run.lines()
    assert "[node-agent n1] worker rank 1 (local 1) failed with exit code 3; stopping local workers" in lines
    assert any("round 2: group rank 0/1" in line and "restart count 1/1" in line for line in lines), lines
    assert lines[-1].startswith("[node-agent n1] job j1 succeeded")


async def test_a_failure_past_the_budget_ends_the_job_with_the_root_cause(start) -> None:
    run = start(max_restarts=0)
    (await run.next_group()).end(r1=-signal.SIGSEGV)
    assert await run.exit_code() == 1
    text = run.console.getvalue()
    assert "job j1 failed" in text and "rank      : 1 (local rank 1)" in text and "signal SIGSEGV" in text


async def test_a_signal_stops_the_workers_leaves_and_exits_128_plus_the_signal(start) -> None:
    run = start()
    group = await run.next_group()
    assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)   # the agent's handler is in place
    os.kill(os.getpid(), signal.SIGTERM)
    assert await run.exit_code() == 128 + signal.SIGTERM
    assert group.stopped_with == signal.SIGTERM and run.server.sent[-1] == "leave"
    assert run.lines()[-1] == "[node-agent n1] node-agent stopped by SIGTERM"
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL            # handlers given back


async def test_the_same_signal_again_within_a_second_is_one_request_a_later_one_forces_the_exit(start, monkeypatch
                                                                                           ) -> None:
    """A Ctrl-C forwarded by a wrapper in the terminal's foreground group (timeout, srun) arrives twice within
    milliseconds: one stop. A second Ctrl-C a second later still forces the exit (SIGKILL, no clean-up)."""
    run = start()
    group = await run.next_group()
    clock, exits = [100.0], []
    monkeypatch.setattr(run.agent, "now", lambda: clock[0])
    monkeypatch.setattr(os, "_exit", exits.append)
    run.agent._on_signal(signal.SIGINT)
    clock[0] += 0.3
    run.agent._on_signal(signal.SIGINT)            # the wrapper's copy of the same Ctrl-C
    assert exits == [] and group.signals == []
    clock[0] += 1.0
    run.agent._on_signal(signal.SIGINT)            # the user's second Ctrl-C
    assert exits == [128 + signal.SIGINT] and group.signals == [signal.SIGKILL]
    assert run.lines()[-1] == "[node-agent n1] second SIGINT: forced exit"


async def test_another_signal_soon_after_the_first_forces_the_exit_too(start, monkeypatch) -> None:
    run = start()
    await run.next_group()
    exits: list[int] = []
    monkeypatch.setattr(os, "_exit", exits.append)
    run.agent._on_signal(signal.SIGTERM)
    run.agent._on_signal(signal.SIGINT)
    assert exits == [128 + signal.SIGINT]


async def test_an_unreachable_server_ends_the_agent_by_its_timer_not_by_another_fact(start) -> None:
    run = start(server_wait=0.3, lease_timeout_s=0.3)
    group = await run.next_group()
    run.server.down = True   # the next try is refused; every later one hangs unanswered
    assert await run.exit_code() == 1
    assert group.stopped_with == signal.SIGTERM
    assert "rendezvous server unreachable" in run.lines()[-1] and "connection refused" in run.lines()[-1]
    outage = run.facts[next(i for i, f in enumerate(run.facts) if isinstance(f, ServerNotReached)):]
    assert [type(f) for f in outage] == [ServerNotReached, DeadlinePassed]


async def test_a_spawn_error_is_reported_as_the_rounds_failure(start) -> None:
    run = start(max_restarts=1)
    missing = WorkerLaunch(local_rank=1, rank=1, argv=["/no/such/python"], env={}, log_dir=None)
    run.spawn_errors.append(WorkerSpawnError(missing, FileNotFoundError(2, "No such file or directory")))
    await run.next_group()                       # this one cannot start
    second = await run.next_group()              # the failure was reported: the next round runs
    assert second.env["TORCHELASTIC_RESTART_COUNT"] == "1"
    assert any("worker rank 1 (local 1) did not start: cannot start '/no/such/python'" in line
               for line in run.lines()), run.lines()
    second.end(r0=0, r1=0)
    assert await run.exit_code() == 0


def seen(rank: int, state: RankState, where: str = "") -> RankSeen:
    return RankSeen(rank=rank, local_rank=rank, state=state, stalled_s=6.0, steps=30, where=where,
                    stack=f"{where}\ntrain.py:9 in <module>" if where else "")


async def test_a_stall_goes_to_the_server_which_names_the_culprit_and_ends_the_round(start) -> None:
    run = start(max_restarts=0)
    group = await run.next_group()
    ranks = (seen(0, RankState.WAITING, "torch/_tensor.py:623 in backward"),
             seen(1, RankState.STOPPED, "train.py:16 in <module>"))
    run.agent.facts.put_nowait(RanksStalled(run.agent.policy.running_round, 5.0, ranks))
    assert await run.exit_code() == 1          # no restart left: the hang fails the job
    assert group.stopped_with == signal.SIGTERM
    text = run.console.getvalue()
    assert "rank 1 (local 1): stopped, cpu 0%, 30 steps, last 6.0s ago at train.py:16 in <module>" in text, text
    assert "rank 1 was stopped at train.py:16 in <module> while rank 0 waited for it" in text, text
    assert "failure   : hang" in text, text


async def test_a_server_that_forgot_the_job_is_joined_again_from_scratch(start) -> None:
    run = start(lease_timeout_s=0.5)
    first = await run.next_group()
    await run.server.restart_without_state()
    second = await run.next_group()
    assert first.stopped_with == signal.SIGTERM and second.env["TORCHELASTIC_RESTART_COUNT"] == "0"
    refusal = next(f for f in run.facts if isinstance(f, ServerRefused))
    assert (refusal.request, refusal.code) == (PollRequest, ErrorCode.UNKNOWN_JOB.value)
    assert run.server.sent.count("join") == 2
    assert any(line.startswith("[node-agent n1] rejoining: no job 'j1'") for line in run.lines()), run.lines()
    second.end(r0=0, r1=0)
    assert await run.exit_code() == 0
    assert isinstance(run.facts[-1], StatusReceived)


class BrokenGroup(FakeGroup):
    async def wait(self) -> list[WorkerExit]:
        raise RuntimeError("a bug in the group")


async def test_a_broken_source_ends_the_agent_loudly_with_its_workers_stopped(start) -> None:
    run = start(group_type=BrokenGroup)
    group = await run.next_group()
    with pytest.raises(RuntimeError, match="a bug in the group"):
        await run.exit_code()
    assert group.stopped_with == signal.SIGTERM


async def test_a_drained_node_says_rejoining_once_and_joins_once_more(start) -> None:
    # The answer that says the server no longer counts the node must not be followed by a fresh poll while the
    # workers stop: its answer (the same news) made the agent say "rejoining" and send its join twice.
    from rdzv_server.core.operator_rules import DrainNode
    run = start()
    group = await run.next_group()
    await run.server.coordinator.operate("j1", DrainNode("n1", "bad GPU"))
    assert await run.exit_code() == 0
    assert group.stopped_with == signal.SIGTERM
    rejoining = [line for line in run.lines() if "rejoining" in line]
    assert len(rejoining) == 1 and run.server.sent.count("join") == 2, (rejoining, run.server.sent)
    assert run.lines()[-1] == "[node-agent n1] node n1 was drained from job 'j1' by the operator (bad GPU)"


async def test_a_stopped_agent_whose_place_is_kept_says_its_stop_is_over_once_its_workers_stopped(start) -> None:
    """The job waits for its next agent from its --stop-timeout's end (LeaveRequest.stop_timeout_s), unless told
    sooner that its stop is over (rdzv_server/core/stops.py): told after its workers stopped, never before."""
    run = start()
    run.agent.policy.restartable = True       # (a SIGTERM may be a restart: an agent of an rdzv-server's job)
    group = await run.next_group()
    leaves: list[tuple[bool, bool, int | None]] = []
    plain = run.server.leave

    async def leave(reason: str, unhealthy: object = None, stopped: bool = False, stop_timeout_s: float = 0.0,
                    stop_ended: bool = False) -> NodeStatus:
        leaves.append((stopped, stop_ended, group.stopped_with))
        status = await plain(reason, None, stopped, stop_timeout_s, stop_ended)
        status.place_kept_s = 0.0 if stop_ended else 20.0        # its memory held state of its own
        status.accepted = True                                    # (a lone node: no wait runs to move)
        return status

    run.server.leave = leave  # type: ignore[method-assign]
    os.kill(os.getpid(), signal.SIGTERM)
    assert await run.exit_code() == 128 + signal.SIGTERM
    assert leaves == [(True, False, None), (True, True, signal.SIGTERM)]
    assert any("n1's stop is over: told the server" in line for line in run.lines()), run.lines()
