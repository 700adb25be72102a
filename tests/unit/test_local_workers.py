"""The round's workers as a source of facts (with a scripted group in place of processes)."""
from __future__ import annotations

import asyncio
import signal

from node_agent.core.facts import Fact, SpawnFailed, WorkersExited
from node_agent.settings import WorkerSettings
from node_agent.training import probe
from node_agent.workers.launch import WorkerLaunch
from node_agent.workers.local import LocalWorkers
from node_agent.workers.process import WorkerExit
from protocol.messages import Assignment
from tests.unit.agent_fakes import LIMIT, FakeGroup


def assignment(round_id: int) -> Assignment:
    return Assignment(round_id=round_id, group_rank=0, group_world_size=1, rank_offset=0, world_size=2,
                      local_world_size=2, master_addr="127.0.0.1", master_port=1, restart_count=0, max_restarts=0)


def local_workers(log_dir: str) -> tuple[LocalWorkers, list[FakeGroup], asyncio.Queue[Fact | BaseException]]:
    facts: asyncio.Queue[Fact | BaseException] = asyncio.Queue()
    groups: list[FakeGroup] = []

    def make(launches: list[WorkerLaunch], *, stop_timeout: float) -> FakeGroup:
        groups.append(FakeGroup(launches, stop_timeout=stop_timeout))
        return groups[-1]

    opts = WorkerSettings(script="train.py", nproc=2, node_id="n1", log_dir=log_dir)
    return LocalWorkers(opts, facts.put_nowait, hostname="h", make_group=make), groups, facts


async def test_a_round_that_succeeded_is_swept_up_before_the_next_one_starts(tmp_path) -> None:
    workers, groups, facts = local_workers(str(tmp_path))
    await workers.spawn(assignment(1))
    groups[0].end(r0=0, r1=0)
    assert await asyncio.wait_for(facts.get(), LIMIT) == WorkersExited(1, ())
    await workers.spawn(assignment(2))
    assert groups[0].stopped_with == signal.SIGTERM and groups[1].stopped_with is None
    await workers.close()
    assert groups[1].stopped_with == signal.SIGTERM


async def test_no_room_for_the_workers_files_is_a_spawn_failure(tmp_path) -> None:
    (tmp_path / "logs").write_text("a file where the log directory would go")
    workers, groups, facts = local_workers(str(tmp_path))
    workers.opts = WorkerSettings(script="train.py", nproc=2, job_id="j", node_id="n1", log_dir=str(tmp_path / "logs"))
    await workers.spawn(assignment(1))
    fact = facts.get_nowait()
    assert isinstance(fact, SpawnFailed) and fact.round_id == 1 and groups == []
    assert fact.failure.reason == "spawn failed" and "train.py" in fact.failure.message


class BrokenGroup(FakeGroup):
    async def wait(self) -> list[WorkerExit]:
        raise RuntimeError("a bug in the group")


async def test_a_source_that_breaks_hands_the_loop_its_exception(tmp_path) -> None:
    facts: asyncio.Queue[Fact | BaseException] = asyncio.Queue()
    opts = WorkerSettings(script="train.py", nproc=2, node_id="n1", log_dir=str(tmp_path))
    workers = LocalWorkers(opts, facts.put_nowait, hostname="h", make_group=BrokenGroup)
    await workers.spawn(assignment(1))
    item = await asyncio.wait_for(facts.get(), LIMIT)
    assert isinstance(item, RuntimeError) and str(item) == "a bug in the group"
    await workers.close()


async def test_a_kill_reaches_a_group_whose_stop_waits_for_its_writes(tmp_path) -> None:
    """The agent's own stop waits for the snapshot writes under way before it signals (up to 5 s); a second Ctrl-C
    meanwhile kills the workers and exits. kill() looked only at the running group, which the stop had taken away:
    it signalled nothing, and the workers' own children (in their groups, no death signal) outlived the agent."""
    facts: asyncio.Queue[Fact | BaseException] = asyncio.Queue()
    release = asyncio.Event()

    class WritesUnderWay(FakeGroup):
        async def stop(self, sig: int = signal.SIGTERM, finish_writes: bool = False) -> None:
            await release.wait()
            await super().stop(sig, finish_writes)

    groups: list[FakeGroup] = []

    def make(launches: list[WorkerLaunch], *, stop_timeout: float) -> FakeGroup:
        groups.append(WritesUnderWay(launches, stop_timeout=stop_timeout))
        return groups[-1]

    opts = WorkerSettings(script="train.py", nproc=2, node_id="n1", log_dir=str(tmp_path))
    workers = LocalWorkers(opts, facts.put_nowait, hostname="h", make_group=make)
    await workers.spawn(assignment(1))
    stopping = asyncio.create_task(workers.stop(signal.SIGTERM, finish_writes=True))
    await asyncio.sleep(0.05)
    workers.kill()
    assert groups[0].signals == [signal.SIGKILL]
    release.set()
    await asyncio.wait_for(stopping, LIMIT)


def note_start(launch: WorkerLaunch, *milestones: str, steps: int = 0) -> None:
    """Write what a worker's probe writes as it reaches `milestones`, `steps` counted (probe.py's record, times)."""
    assert launch.probe is not None
    with open(launch.probe.record, "r+b") as f:
        f.write(probe.RECORD.pack(probe.MAGIC, probe.VERSION, 0, steps, 4.0 if steps else 0.0,
                                  4.5 if steps else 0.0, 4242, 0, 1, -1))
        f.seek(probe.TIMES_AT)
        f.write(probe.TIMES.pack(*(5.0 if m in milestones else 0.0 for m in probe.MILESTONES)))


async def test_a_worker_that_failed_before_its_process_group_says_so(tmp_path) -> None:
    # A script's ImportError fails its worker before it begins torch.distributed's group: no peer's loss broke
    # it, which the server weighs (rdzv_server/core/blame.py); a worker that had begun one may be a victim.
    workers, groups, facts = local_workers(str(tmp_path))
    await workers.spawn(assignment(1))
    note_start(groups[0].launches[0], "started")
    note_start(groups[0].launches[1], "started", "group_begun")
    groups[0].end(r0=1, r1=1)
    fact = await asyncio.wait_for(facts.get(), LIMIT)
    assert isinstance(fact, WorkersExited)
    assert [(f.local_rank, f.before_group) for f in fact.failures] == [(0, True), (1, False)]
    await workers.close()


async def test_a_worker_that_stepped_without_a_process_group_is_past_its_start(tmp_path) -> None:
    # A program that never calls init_process_group (torch.distributed.rpc, its own sockets) and fails after its
    # optimizer stepped may be a peer's victim: said "before its group", it took the count off the culprit's node
    # (blame.shared) and kept every node from its exclusion for a window (blame.elsewhere).
    workers, groups, facts = local_workers(str(tmp_path))
    await workers.spawn(assignment(1))
    note_start(groups[0].launches[0], "started", steps=3)
    note_start(groups[0].launches[1], "started")
    groups[0].end(r0=1, r1=1)
    fact = await asyncio.wait_for(facts.get(), LIMIT)
    assert isinstance(fact, WorkersExited)
    assert [(f.local_rank, f.before_group) for f in fact.failures] == [(0, False), (1, True)]
    await workers.close()
