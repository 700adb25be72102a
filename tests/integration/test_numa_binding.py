"""--numa-binding on real worker processes: a fake sysfs tree (two NUMA nodes, one CPU each: CPUs that
exist on a 2-core box) and a fake NVML give each local rank its CPU set; the spawned worker reads its own
affinity before anything else. And a worker that outlives SIGKILL is named, not waited for forever."""
from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from node_agent.gpu.node import survey
from node_agent.settings import WorkerSettings
from node_agent.workers.deathsig import child_setup
from node_agent.workers.group import WorkerGroup
from node_agent.workers.launch import build_launches
from protocol.messages import Assignment
from tests.gpu_fakes import FakeGpuReader
from tests.integration.worker_support import LIMIT, RecordingConsole, kill_strays, launch
from tests.unit.test_gpu_topology import write_machine

pytestmark = pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="needs CPUs 0 and 1")

SHOW_AFFINITY = "import os; print('cpus', sorted(os.sched_getaffinity(0)), flush=True)"


def two_node_box(root: Path) -> FakeGpuReader:
    """NUMA node 0 = CPU 0 with GPU 0000:1b:00.0, node 1 = CPU 1 with GPU 0000:1c:00.0."""
    write_machine(root, nodes={0: [0], 1: [1]}, socket={0: 0, 1: 1}, siblings={0: [0], 1: [1]}, l3=None,
                  gpus={"0000:1b:00.0": 0, "0000:1c:00.0": 1})
    return FakeGpuReader.with_gpus(2)


def assignment(restart_count: int = 0) -> Assignment:
    return Assignment(round_id=1 + restart_count, group_rank=0, group_world_size=1, rank_offset=0, world_size=2,
                      local_world_size=2, master_addr="127.0.0.1", master_port=29500, restart_count=restart_count,
                      max_restarts=3)


@pytest.fixture
def strays() -> Iterator[list[int]]:
    pids: list[int] = []
    yield pids
    kill_strays(pids)


@pytest.mark.parametrize("visible, expected", [(None, {0: [0], 1: [1]}), ("1,0", {0: [1], 1: [0]})])
async def test_each_spawned_worker_runs_on_its_gpu_s_numa_node_at_every_restart(tmp_path, visible, expected) -> None:
    reader = two_node_box(tmp_path / "sys")
    environ = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    if visible is not None:
        environ["CUDA_VISIBLE_DEVICES"] = visible
    gpus = survey(2, environ, reader=reader, numa_binding="node", root=str(tmp_path / "sys"), allowed=frozenset({0, 1}))
    assert gpus.warnings == () and len(gpus.lines) == 2
    opts = WorkerSettings(script="train.py", nproc=2)
    for restart in (0, 1):            # the same binding for a restarted worker
        launches = build_launches(assignment(restart), opts, run_dir=str(tmp_path / "logs"), hostname="h",
                                  environ=environ, cpu_affinity=gpus.cpu_affinity)
        # the launches' own bindings, on a program that shows its CPUs
        launches = [launch(la.local_rank, SHOW_AFFINITY, cpu_affinity=la.cpu_affinity) for la in launches]
        group = WorkerGroup(launches, stop_timeout=5.0, console=RecordingConsole())
        await group.start()
        exits = await asyncio.wait_for(group.wait(), LIMIT)
        assert [e.exitcode for e in exits] == [0, 0]
        console = group._console
        assert isinstance(console, RecordingConsole)
        for rank, cpus in expected.items():
            assert await console.seen(f"[h:rank {10 + rank}] cpus {cpus}")


async def test_an_unbound_launch_keeps_the_agent_s_cpus() -> None:
    group = WorkerGroup([launch(0, SHOW_AFFINITY)], stop_timeout=5.0, console=RecordingConsole())
    await group.start()
    await asyncio.wait_for(group.wait(), LIMIT)
    console = group._console
    assert isinstance(console, RecordingConsole)
    assert await console.seen(f"cpus {sorted(os.sched_getaffinity(0))}")


def test_the_child_setup_pins_the_process_it_runs_in() -> None:
    pid = os.fork()
    if pid == 0:                        # the child: what a warm (forked) worker would call too
        child_setup(os.getppid(), None, frozenset({1}))
        os._exit(0 if os.sched_getaffinity(0) == {1} else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


async def test_a_worker_alive_after_sigkill_is_named_and_not_waited_for(strays) -> None:
    group = WorkerGroup([launch(0, "import time; print('up', flush=True); time.sleep(600)")], stop_timeout=0.1,
                        console=RecordingConsole(), kill_timeout=0.3)
    await group.start()
    strays.extend(group.pids)
    for worker in group._workers:       # the shim: no signal reaches it, as none ends a process in D state
        worker.signal_group = lambda sig: None   # type: ignore[method-assign]
    await asyncio.wait_for(group.stop(), LIMIT)
    assert group.stuck_pids == group.pids
    console = group._console
    assert isinstance(console, RecordingConsole)
    assert "1 worker(s) still alive 0.3s after SIGKILL" in console.lines("stderr")[-1]
    os.kill(group.pids[0], signal.SIGKILL)
