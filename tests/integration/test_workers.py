"""A round's workers as a group, with real processes: first failure, stopping, escalation, spawn errors."""
from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Callable, Iterator

import psutil
import pytest

from node_agent.workers.error_file import read_error_file
from node_agent.workers.group import WorkerGroup
from node_agent.workers.launch import WorkerLaunch
from node_agent.workers.process import WorkerSpawnError
from tests.integration.worker_support import LIMIT, RecordingConsole, kill_strays, launch


@pytest.fixture
def strays() -> Iterator[list[int]]:
    """Pids a test learned of that are not our children: killed at teardown if still there."""
    pids: list[int] = []
    yield pids
    kill_strays(pids)


@pytest.fixture
async def make_group() -> AsyncIterator[Callable[..., WorkerGroup]]:
    made: list[WorkerGroup] = []

    def make(launches: list[WorkerLaunch], *, stop_timeout: float = 5.0) -> WorkerGroup:
        group = WorkerGroup(launches, stop_timeout=stop_timeout, console=RecordingConsole())
        made.append(group)
        return group

    yield make
    for group in made:   # whatever the test did, no worker outlives it
        await asyncio.wait_for(group.stop(signal.SIGKILL), LIMIT)


def console_of(group: WorkerGroup) -> RecordingConsole:
    c = group._console
    assert isinstance(c, RecordingConsole)
    return c


async def test_wait_returns_every_exit_once_all_succeeded(make_group) -> None:
    group = make_group([launch(i, f"import time; time.sleep({0.2 * i})") for i in range(3)])
    await group.start()
    exits = await asyncio.wait_for(group.wait(), LIMIT)
    assert sorted((e.local_rank, e.rank, e.exitcode, e.signal_name) for e in exits) == \
        [(i, 10 + i, 0, "") for i in range(3)]
    assert exits == group.exits() and sorted(e.pid for e in exits) == sorted(group.pids)


async def test_failure_is_reported_while_others_still_run(make_group, strays) -> None:
    failing = """
        import subprocess, sys
        # A child that keeps our stdout open must not delay the report of our exit.
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print("grandchild", p.pid, flush=True)
        sys.exit(3)
    """
    sleeper = """
        import time
        print("sleeper up", flush=True)
        time.sleep(600)
    """
    # What is shown is what happened, not how long it took: the grandchild (600 s) and the escalation (10 x LIMIT)
    # both outlast the LIMIT every wait here is bounded by, so waiting on either fails the test.
    group = make_group([launch(0, sleeper), launch(1, failing)], stop_timeout=10 * LIMIT)
    await group.start()
    for pid in group.pids:
        assert os.getpgid(pid) == pid != os.getpgid(0)   # each worker leads its own process group
    failures = await asyncio.wait_for(group.wait(), LIMIT)
    assert [(f.local_rank, f.rank, f.exitcode, f.signal_name) for f in failures] == [(1, 11, 3, "")]
    sleeper_proc = psutil.Process(group.pids[0])
    assert sleeper_proc.status() != psutil.STATUS_ZOMBIE and len(group.exits()) == 1

    grandchild = int((await console_of(group).seen("grandchild")).split()[-1])
    strays.append(grandchild)
    assert os.getpgid(grandchild) == group.pids[1]
    grandchild_proc = psutil.Process(grandchild)
    assert grandchild_proc.status() != psutil.STATUS_ZOMBIE     # it holds the stdout still: the exit was not held

    await asyncio.wait_for(group.stop(), LIMIT)       # SIGTERM sufficed: no wait for the escalation
    by_rank = {e.local_rank: e for e in group.exits()}
    assert (by_rank[0].exitcode, by_rank[0].signal_name) == (-signal.SIGTERM, "SIGTERM")
    assert not sleeper_proc.is_running()
    # The failed worker's child, left in its process group, is swept away by the stop.
    await asyncio.to_thread(grandchild_proc.wait, 10)


async def test_stop_escalates_to_sigkill(make_group) -> None:
    stubborn = """
        import signal, time
        signal.signal(signal.SIGTERM, lambda *_: print("SIGTERM ignored", flush=True))
        print("ignoring SIGTERM", flush=True)
        time.sleep(600)
    """
    group = make_group([launch(0, stubborn)], stop_timeout=0.5)
    await group.start()
    await console_of(group).seen("ignoring SIGTERM")
    # Stops may overlap each other and a wait(): all end together, with one result.
    _, _, exits = await asyncio.wait_for(asyncio.gather(group.stop(), group.stop(), group.wait()), LIMIT)
    assert [(e.exitcode, e.signal_name) for e in exits] == [(-signal.SIGKILL, "SIGKILL")]
    # In that order: SIGTERM, which it lived through, then SIGKILL (timing the stop broke on a loaded host).
    assert "SIGTERM ignored" in await console_of(group).seen("SIGTERM ignored")
    assert group.exits() == exits
    await asyncio.wait_for(group.stop(), 1)   # again: returns at once


async def test_stop_during_start_spawns_no_more(make_group) -> None:
    group = make_group([launch(i, "import time; time.sleep(600)") for i in range(4)])
    starting = asyncio.create_task(group.start())
    await asyncio.wait_for(group.stop(), LIMIT)   # arrives while the first worker is being spawned
    await asyncio.wait_for(starting, LIMIT)
    assert 1 <= len(group.pids) < 4
    assert sorted(e.pid for e in group.exits()) == sorted(group.pids)
    assert all(e.signal_name == "SIGTERM" for e in group.exits())
    with pytest.raises(RuntimeError):
        await group.start()


async def test_send_signal_reaches_workers(make_group) -> None:
    code = """
        import signal, sys, time
        def on_usr1(*_):
            print("got usr1", flush=True)
            sys.exit(0)
        signal.signal(signal.SIGUSR1, on_usr1)
        print("ready", flush=True)
        time.sleep(600)
    """
    group = make_group([launch(0, code)])
    await group.start()
    await console_of(group).seen("ready")
    group.send_signal(signal.SIGUSR1)
    exits = await asyncio.wait_for(group.wait(), LIMIT)
    assert [e.exitcode for e in exits] == [0]
    await console_of(group).seen("got usr1")


async def test_spawn_error_stops_the_started_workers(make_group, tmp_path) -> None:
    sleeper = "import time; time.sleep(600)"
    missing = WorkerLaunch(local_rank=1, rank=11, argv=[str(tmp_path / "no-such-program")],
                           env=dict(os.environ), log_dir=None)
    group = make_group([launch(0, sleeper), missing])
    with pytest.raises(WorkerSpawnError) as info:
        await group.start()
    assert isinstance(info.value, OSError) and info.value.launch is missing
    assert "local rank 1" in str(info.value) and "no-such-program" in str(info.value)
    assert [(e.local_rank, e.signal_name) for e in group.exits()] == [(0, "SIGKILL")]


TORCH_ERROR = {"message": {"message": "ValueError: boom", "extraInfo": {
    "py_callstack": "Traceback (most recent call last):\n  File \"t.py\", line 1\nValueError: boom\n",
    "timestamp": "1700000000"}}}


async def test_error_file_is_reported_and_stale_ones_removed(make_group, tmp_path) -> None:
    writer = f"""
        import json, os, sys
        path = os.environ["TORCHELASTIC_ERROR_FILE"]
        if os.path.exists(path):
            sys.exit(7)   # a stale file from an earlier run must be gone before we start
        with open(path, "w") as f:
            json.dump({TORCH_ERROR!r}, f)
        sys.exit(1)
    """
    paths = [tmp_path / str(i) / "error.json" for i in range(2)]
    for path in paths:
        path.parent.mkdir()
        path.write_text("stale")
    group = make_group([launch(0, writer, env={"TORCHELASTIC_ERROR_FILE": str(paths[0])}),
                        launch(1, "pass", env={"TORCHELASTIC_ERROR_FILE": str(paths[1])})])
    await group.start()
    failures = await asyncio.wait_for(group.wait(), LIMIT)
    await group.stop()
    assert [(f.local_rank, f.exitcode, f.error_file) for f in failures] == [(0, 1, str(paths[0]))]
    message, traceback, timestamp = read_error_file(str(paths[0])) or ("", "", 0.0)
    assert (message, timestamp) == ("ValueError: boom", 1700000000.0)
    assert traceback.startswith("Traceback") and traceback.endswith("ValueError: boom\n")
    other = [e for e in group.exits() if e.local_rank == 1][0]
    assert other.error_file is None and not paths[1].exists()
