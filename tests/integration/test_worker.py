"""One worker process, for real: its process group, its death with the agent, signals."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Callable, Iterator

import psutil
import pytest

from node_agent.settings import Std
from node_agent.workers.deathsig import prctl, preexec
from node_agent.workers.launch import WorkerLaunch
from node_agent.workers.process import Worker, WorkerExit, signal_name
from tests.integration.worker_support import LIMIT, ROOT, RecordingConsole, kill_strays, launch


@pytest.fixture
def strays() -> Iterator[list[int]]:
    """Pids a test learned of that are not our children: killed at teardown if still there."""
    pids: list[int] = []
    yield pids
    kill_strays(pids)


@pytest.fixture
async def make_worker() -> AsyncIterator[Callable[..., Worker]]:
    made: list[Worker] = []

    def make(launch_: WorkerLaunch, **kw: object) -> Worker:
        worker = Worker(launch_, console=RecordingConsole(), **kw)  # type: ignore[arg-type]
        made.append(worker)
        return worker

    yield make
    for worker in made:   # whatever the test did, no process outlives it
        worker.signal_group(signal.SIGKILL)
        if worker.reaper is not None:
            await asyncio.wait_for(worker.reaper, LIMIT)


def console_of(worker: Worker) -> RecordingConsole:
    c = worker._console
    assert isinstance(c, RecordingConsole)
    return c


async def test_a_worker_leads_its_own_process_group_and_its_exit_is_reported_once(make_worker) -> None:
    seen: list[WorkerExit] = []
    worker = make_worker(launch(2, "import sys; print('hi', flush=True); sys.exit(4)"), on_exit=seen.append)
    assert worker.pid is None and not worker.running
    await worker.start()
    assert worker.pid is not None and os.getpgid(worker.pid) == worker.pid != os.getpgid(0)
    assert worker.reaper is not None
    exit_ = await asyncio.wait_for(worker.reaper, LIMIT)
    assert (exit_.local_rank, exit_.rank, exit_.pid, exit_.exitcode, exit_.signal_name, exit_.error_file) == \
        (2, 12, worker.pid, 4, "", None)
    assert seen == [exit_] and worker.exit == exit_ and not worker.running
    await console_of(worker).seen("[h:rank 12] hi")


async def test_the_group_is_signalled_after_its_leader_exited_and_forgotten_once_empty(make_worker,
                                                                                        strays) -> None:
    code = """
        import subprocess, sys
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print("child", p.pid, flush=True)
    """
    worker = make_worker(launch(0, code))
    await worker.start()
    child = int((await console_of(worker).seen("child")).split()[-1])
    strays.append(child)
    assert worker.reaper is not None
    assert (await asyncio.wait_for(worker.reaper, LIMIT)).exitcode == 0
    worker.send_signal(signal.SIGTERM)          # the worker no longer runs: nothing is sent
    assert psutil.Process(child).status() != psutil.STATUS_ZOMBIE
    worker.signal_group(signal.SIGTERM)         # its group still has the child: that one is sent
    await asyncio.to_thread(psutil.Process(child).wait, LIMIT)
    worker.signal_group(signal.SIGKILL)         # the group is empty now: no error, nothing sent
    assert not worker.group_alive


async def test_a_worker_not_yet_leading_its_own_group_is_signalled_itself(make_worker) -> None:
    # A warm worker the zygote has just forked is ours before it has called setsid(): its group does
    # not exist yet. Stand-in: a process in the test's own group, as the worker's process.
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(600)")
    worker = make_worker(launch(0, "pass"))
    worker._proc, worker.group_alive = proc, True        # type: ignore[assignment]
    try:
        worker.signal_group(signal.SIGKILL)
        assert await asyncio.wait_for(proc.wait(), LIMIT) == -signal.SIGKILL
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_send_signal_reaches_a_running_worker(make_worker) -> None:
    code = """
        import signal, sys, time
        signal.signal(signal.SIGUSR1, lambda *_: sys.exit(0))
        print("ready", flush=True)
        time.sleep(600)
    """
    worker = make_worker(launch(0, code))
    await worker.start()
    await console_of(worker).seen("ready")
    assert worker.running
    worker.send_signal(signal.SIGUSR1)
    assert worker.reaper is not None
    assert (await asyncio.wait_for(worker.reaper, LIMIT)).exitcode == 0


async def test_a_worker_that_cannot_start_raises_and_leaves_nothing_open(make_worker, tmp_path) -> None:
    before = set(os.listdir("/proc/self/fd"))
    worker = make_worker(WorkerLaunch(local_rank=0, rank=0, argv=[str(tmp_path / "missing")], env={},
                                      log_dir=str(tmp_path / "logs"), tee=Std.ALL))
    with pytest.raises(FileNotFoundError):
        await worker.start()
    assert worker.pid is None and worker.reaper is None
    assert set(os.listdir("/proc/self/fd")) == before   # pipes and log files closed again


def test_signal_names() -> None:
    assert (signal_name(0), signal_name(3), signal_name(-signal.SIGKILL), signal_name(-200)) == \
        ("", "", "SIGKILL", "SIG200")


async def test_worker_dies_with_a_sigkilled_agent(strays) -> None:
    parent_code = textwrap.dedent(f"""
        import asyncio, os, sys
        sys.path.insert(0, {ROOT!r})
        from node_agent.workers.launch import WorkerLaunch
        from node_agent.workers.output import Console
        from node_agent.workers.process import Worker

        async def main():
            argv = [sys.executable, "-c", "import time; time.sleep(600)"]
            worker = Worker(WorkerLaunch(local_rank=0, rank=0, argv=argv, env=dict(os.environ), log_dir=None),
                            console=Console())
            await worker.start()
            print(worker.pid, flush=True)
            await asyncio.Event().wait()   # until killed

        asyncio.run(main())
    """)
    parent = await asyncio.create_subprocess_exec(sys.executable, "-c", parent_code, stdout=subprocess.PIPE)
    try:
        line = await asyncio.wait_for(parent.stdout.readline(), LIMIT)  # type: ignore[union-attr]
        worker_pid = int(line)
        strays.append(worker_pid)
        worker = psutil.Process(worker_pid)
        assert worker.ppid() == parent.pid
        parent.kill()
        await parent.wait()
        await asyncio.to_thread(worker.wait, 5)   # raises TimeoutExpired if it outlived its agent
        assert not worker.is_running()
    finally:
        if parent.returncode is None:
            parent.kill()
            await parent.wait()


def test_child_exits_when_its_parent_is_already_gone(tmp_path) -> None:
    # The child setup compares getppid() with the pid the agent had at fork time; a mismatch means
    # the agent died before PDEATHSIG was armed, and the child must not go on to run the worker.
    marker = tmp_path / "ran"
    proc = subprocess.Popen([sys.executable, "-c", f"open({str(marker)!r}, 'w')"],
                            preexec_fn=preexec(os.getpid() + 1_000_000, prctl()))
    assert proc.wait(timeout=LIMIT) == 1
    assert not marker.exists()
