"""A GPU node's own checks in the whole agent loop (node_checks.py, core/node_health.py): the real Agent and
the in-process server (LocalClient), a scripted worker group, a fake NVML (FakeGpuReader) and a fake /dev.
The test breaks a GPU, a --health-check or a worker's death and awaits what the node does."""
from __future__ import annotations

import asyncio
import io
import os
import signal
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import msgspec
import pytest

from node_agent.agent import Agent
from node_agent.core.actions import CheckNode
from node_agent.core.facts import NodeChecked, Stage
from node_agent.node_checks import NodeChecks
from node_agent.settings import CheckSettings, Mode
from node_agent.workers.launch import WorkerLaunch
from protocol.messages import JobConfig, UnhealthyKind, WorkerFailure
from protocol.quoting import quote
from rdzv_server.web import views
from rdzv_server.web.page import parts
from tests.gpu_fakes import FakeGpuReader, healthy
from tests.unit.agent_fakes import LIMIT, FakeGroup, agent_settings
from tests.unit.test_agent_loop import ScriptedServer
from tests.unit.test_gpu_topology import write_machine


class RecordingChecks(NodeChecks):
    """The agent's own checks, handing every answer to the test too."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.answers: asyncio.Queue[NodeChecked] = asyncio.Queue()

    async def check(self, action: CheckNode, stuck: Sequence[int] = ()) -> NodeChecked:
        answer = await super().check(action, stuck)
        self.answers.put_nowait(answer)
        return answer

    async def next(self, stage: str | None = None) -> NodeChecked:
        while True:
            answer = await asyncio.wait_for(self.answers.get(), LIMIT)
            if stage is None or answer.stage == stage:
                return answer


class StuckGroup(FakeGroup):
    """Workers that outlive SIGKILL (what WorkerGroup reports after --kill-timeout)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.stuck_pids = [4242]


@dataclass
class Node:
    agent: Agent
    server: ScriptedServer
    checks: RecordingChecks
    reader: FakeGpuReader
    console: io.StringIO
    groups: asyncio.Queue[FakeGroup]
    task: asyncio.Task[int]
    made: list[FakeGroup] = field(default_factory=list)

    async def next_group(self) -> FakeGroup:
        return await asyncio.wait_for(self.groups.get(), LIMIT)

    def text(self) -> str:
        return self.console.getvalue()

    def events(self) -> list[tuple[str, str]]:
        job = self.server.coordinator.core.jobs["j1"]
        return [(e.kind, e.message) for e in job.events]


def dev_with_gpus(tmp_path: Path, count: int) -> str:
    dev = tmp_path / "dev"
    dev.mkdir(exist_ok=True)
    for i in range(count):
        (dev / f"nvidia{i}").touch()
    (dev / "nvidiactl").touch()
    return str(dev)


@pytest.fixture
async def start(tmp_path) -> AsyncIterator[Callable[..., Node]]:
    nodes: list[Node] = []

    def start_node(*, gpus: int = 2, nproc: int = 2, reader: FakeGpuReader | None = None,
                   group_type: type[FakeGroup] = FakeGroup, **opts: object) -> Node:
        config = JobConfig(last_call_s=0.0, max_restarts=3)
        options = agent_settings(**{"script": "train.py", "nproc": nproc, "job_id": "j1", "job": config,
                                  "node_id": "n1", "mode": Mode.STANDALONE, "log_dir": str(tmp_path),
                                  "stop_timeout": 1.0, "gpu_check_interval": 0.05, **opts})  # type: ignore[arg-type]
        reader = reader if reader is not None else FakeGpuReader.with_gpus(gpus)
        console = io.StringIO()
        server = ScriptedServer("j1", "n1")
        groups: asyncio.Queue[FakeGroup] = asyncio.Queue()
        made: list[FakeGroup] = []

        def make_group(launches: list[WorkerLaunch], *, stop_timeout: float) -> FakeGroup:
            group = group_type(launches, stop_timeout=stop_timeout)
            made.append(group)
            groups.put_nowait(group)
            return group

        agent = Agent(options, server, "127.0.0.1", console, make_group=make_group)
        checks = RecordingChecks(options.checks, agent.narrator.say, reader=lambda: reader,
                                 root=str(tmp_path / "sysfs"), dev_dir=dev_with_gpus(tmp_path, gpus))
        agent.checks = checks
        node = Node(agent, server, checks, reader, console, groups, asyncio.create_task(agent.run()), made)
        nodes.append(node)
        return node

    yield start_node
    for node in nodes:
        node.task.cancel()
        await asyncio.gather(node.task, return_exceptions=True)


def bus(index: int) -> str:
    return f"0000:{0x1b + index:02x}:00.0"       # FakeGpuReader.with_gpus's addresses


def ecc(index: int, count: int = 2):
    return replace(healthy(index, bus(index)), uncorrectable_ecc=count)


async def test_a_healthy_gpu_node_checks_before_joining_then_runs(start) -> None:
    node = start()
    answer = await node.checks.next(Stage.JOIN)
    assert answer.problem is None and node.reader.asked == [0, 1]      # the two GPUs its workers use
    group = await node.next_group()
    assert node.server.coordinator.core.jobs["j1"].nodes["n1"].checks == "GPU check on (NVML, held open)"
    assert node.server.sent[0] == "join"
    group.end(r0=0, r1=0)
    assert await asyncio.wait_for(node.task, LIMIT) == 0
    assert node.reader.closed == 1                                       # NVML held until the agent ends


async def test_an_unhealthy_gpu_keeps_the_node_out_until_it_is_repaired_in_place(start) -> None:
    reader = FakeGpuReader.with_gpus(2, name="H100")
    reader.faults[1] = ecc(1)
    node = start(reader=reader)
    answer = await node.checks.next(Stage.JOIN)
    assert answer.kind is UnhealthyKind.GPU
    assert "GPU 1 (0000:1c:00.0): 2 volatile uncorrectable ECC errors" in answer.problem
    assert "join" not in node.server.sent
    assert "not joining: this node is unhealthy: GPU check: GPU 1 (0000:1c:00.0): 2 volatile uncorrectable ECC" \
        in node.text()
    reader.faults.clear()                                                # repaired: the next check passes
    await node.next_group()
    assert node.server.sent[:2] == ["leave", "join"]      # said once why it is missing, then joined


async def test_a_gpu_that_breaks_while_workers_run_makes_the_node_leave_without_a_restart(start) -> None:
    node = start()
    group = await node.next_group()
    node.reader.faults[0] = replace(healthy(0, bus(0)), lost="GPU is lost")
    answer = await node.checks.next(Stage.RUNNING)
    while answer.problem is None:                                       # checks made before the fault
        answer = await node.checks.next(Stage.RUNNING)
    await asyncio.wait_for(_left(node), LIMIT)
    assert group.stopped_with == signal.SIGTERM
    assert "failure" not in node.server.sent
    job = node.server.coordinator.core.jobs["j1"]
    assert job.restart_count == 0
    assert any(kind == "node_unhealthy" and "unhealthy: GPU check: GPU 0 (0000:1b:00.0): NVML: GPU is lost" in reason
               for kind, reason in node.events())
    node.reader.faults.clear()                          # repaired in place: it checks, rejoins, runs again
    again = await node.next_group()
    assert again.env["TORCHELASTIC_RESTART_COUNT"] == "0"
    again.end(r0=0, r1=0)
    assert await asyncio.wait_for(node.task, LIMIT) == 0


async def _left(node: Node) -> None:
    while "leave" not in node.server.sent:
        await node.checks.answers.get()     # nothing else to await: each check is a step of the loop


async def test_a_worker_failure_on_a_broken_gpu_leaves_instead_of_counting_a_restart(start) -> None:
    node = start()
    group = await node.next_group()
    node.reader.faults[1] = ecc(1, 1)
    group.end(r1=1)
    answer = await node.checks.next(Stage.FAILURE)
    assert answer.kind is UnhealthyKind.GPU and answer.failures[0].local_rank == 1
    await asyncio.wait_for(_left(node), LIMIT)
    assert "failure" not in node.server.sent
    assert node.server.coordinator.core.jobs["j1"].restart_count == 0


async def test_a_worker_failure_on_healthy_gpus_is_reported_and_restarts_after_a_check(start) -> None:
    node = start()
    first = await node.next_group()
    first.end(r1=1)
    assert (await node.checks.next(Stage.FAILURE)).problem is None
    assert (await node.checks.next(Stage.RESTART)).problem is None     # the restart waits for its check
    second = await node.next_group()
    assert second.env["TORCHELASTIC_RESTART_COUNT"] == "1" and node.server.sent.count("failure") == 1


async def test_a_failing_health_check_before_a_restart_makes_the_node_leave(start, tmp_path) -> None:
    flag = tmp_path / "broken"
    script = tmp_path / "check.sh"
    script.write_text(f"#!/bin/sh\nif [ -e {flag} ]; then echo 'IB port 1 down'; echo more; exit 3; fi\n")
    script.chmod(0o755)
    # no check while the workers run: one in flight as the flag appears would find the node unhealthy before the
    # restart (its script read the flag late on a loaded machine: the restart's check never came)
    node = start(health_check=str(script), gpu_check_interval=3600.0)
    first = await node.next_group()
    flag.touch()
    first.end(r1=1)
    answer = await node.checks.next(Stage.RESTART)
    assert answer.kind is UnhealthyKind.HEALTH_CHECK
    assert answer.problem == f"health check {quote(str(script))} exited with status 3: 'IB port 1 down'"
    await asyncio.wait_for(_left(node), LIMIT)
    assert len(node.made) == 1                                          # the restart never spawned here


async def test_workers_that_outlive_sigkill_make_the_node_leave(start) -> None:
    node = start(group_type=StuckGroup, gpus=0, health_check="true")   # any node: not only a GPU node
    group = await node.next_group()
    group.end(r1=1)                                     # stopping the failed group leaves 4242 behind
    await asyncio.wait_for(_left(node), LIMIT)
    assert any(kind == "node_unhealthy" and "worker process 4242 still alive 10s after SIGKILL" in reason
               for kind, reason in node.events()), node.events()


async def test_nvml_missing_on_a_gpu_node_is_one_warning_and_the_job_runs(start) -> None:
    node = start(reader=FakeGpuReader(unavailable="nvidia-ml-py is not installed"))
    group = await node.next_group()
    job = node.server.coordinator.core.jobs["j1"]
    shown = views.job_detail(job, 0.0).nodes[0]
    assert shown.checks == "GPU check skipped: nvidia-ml-py is not installed"      # the server's views say so
    assert '<span class="warn-text">GPU check skipped: nvidia-ml-py is not installed</span>' in parts.host(shown)
    group.end(r0=0, r1=0)
    assert await asyncio.wait_for(node.task, LIMIT) == 0
    assert node.text().count("warning: GPU check skipped: nvidia-ml-py is not installed") == 1


async def test_more_workers_than_gpus_is_one_warning_naming_both_before_workers_start(start) -> None:
    node = start(gpus=4, nproc=8)
    group = await node.next_group()
    text = node.text()
    assert text.count("8 workers but 4 GPUs visible") == 1
    group.end(**{f"r{i}": 0 for i in range(8)})
    assert await asyncio.wait_for(node.task, LIMIT) == 0


async def test_a_failure_naming_a_gpu_fault_is_the_gpu_s_and_a_device_side_assert_the_user_s(tmp_path) -> None:
    checks = NodeChecks(CheckSettings(), lambda line: None, reader=lambda: FakeGpuReader.with_gpus(1),
                        root=str(tmp_path), dev_dir=dev_with_gpus(tmp_path, 1))
    checks.start()
    ecc_failure = WorkerFailure(local_rank=0, rank=3, exitcode=1,
                                message="RuntimeError: CUDA error: uncorrectable ECC error encountered")
    answer = await checks.check(CheckNode(Stage.FAILURE, 2, (ecc_failure,)))
    assert answer.kind is UnhealthyKind.GPU_FAULT and "uncorrectable ECC error" in answer.problem
    assert answer.failures == (ecc_failure,)
    assert_failure = msgspec.structs.replace(ecc_failure,
                                             message="RuntimeError: CUDA error: device-side assert triggered")
    assert (await checks.check(CheckNode(Stage.FAILURE, 2, (assert_failure,)))).problem is None
    checks.close()


async def test_a_host_held_out_by_the_server_asks_again_after_a_back_off_and_joins_once_cleared(start) -> None:
    node = start()
    held = node.server.coordinator.core.unhealthy
    held.hold_s = 3600.0                              # as rdzv-server's (the in-process server holds nobody)
    now = node.server.coordinator.clock()                               # the server's clock: wall time
    held.hold(node.agent.hostname, "gpu", "unhealthy: GPU check: ...", "j0", "n0", now)
    joins = await node.checks.next(Stage.JOIN)
    assert joins.problem is None                                        # its own check passes ...
    while "held out as unhealthy" not in node.text():                   # ... but the server refuses it
        assert (await node.checks.next(Stage.JOIN)).problem is None
    assert "the server keeps this host out: host" in node.text()
    assert node.task.done() is False and node.made == []
    held.clear(node.agent.hostname, now)                                # the operator's clear-unhealthy
    await node.next_group()


async def test_numa_binding_reaches_every_worker_s_launch_and_is_said_once(start, tmp_path) -> None:
    write_machine(tmp_path / "sysfs", nodes={0: [0, 2], 1: [1, 3]}, socket={0: 0, 1: 1, 2: 0, 3: 1},
                  siblings={0: [0], 1: [1], 2: [2], 3: [3]}, l3=None, gpus={bus(0): 1, bus(1): 0})
    node = start(numa_binding="node")
    first = await node.next_group()
    # the agent's own affinity on this box cuts the sets; the plan's CPUs are what it may use
    allowed = os.sched_getaffinity(0)
    assert [la.cpu_affinity for la in first.launches] == [frozenset({1, 3} & allowed) or None,
                                                         frozenset({0, 2} & allowed) or None]
    first.end(r1=1)
    second = await node.next_group()                   # a restart gets the same binding
    assert [la.cpu_affinity for la in second.launches] == [la.cpu_affinity for la in first.launches]
    assert node.text().count("NUMA binding, local rank 1: NUMA node 0") == (1 if {0, 2} & allowed else 0)


async def test_a_health_check_that_cannot_run_keeps_the_node_out_saying_why(start, tmp_path) -> None:
    script = tmp_path / "check.sh"
    script.write_text("#!/bin/sh\nexit 0\n")            # not executable
    node = start(health_check=str(script))
    answer = await node.checks.next(Stage.JOIN)
    assert answer.kind is UnhealthyKind.HEALTH_CHECK
    assert answer.problem == f"health check {quote(str(script))} is not executable (permission denied)"
    assert f"not joining: this node is unhealthy: {answer.problem}" in node.text()
    assert "join" not in node.server.sent


def test_each_local_rank_reads_its_own_gpus_utilization(tmp_path) -> None:
    reader = FakeGpuReader.with_gpus(2)
    reader.busy = {0: 97, 1: 4}
    checks = NodeChecks(CheckSettings(nproc=3), lambda line: None, reader=lambda: reader, root=str(tmp_path),
                        dev_dir=dev_with_gpus(tmp_path, 2))
    assert checks.gpu_busy(0) is None                        # not started: nothing to read
    checks.start()
    assert [checks.gpu_busy(r) for r in range(4)] == [97, 4, None, None]   # rank 2 has no GPU of its own
    checks.close()
