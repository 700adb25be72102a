"""The round's c10d store hosted beside the workers (workers/warm/store_host.py): real processes, real torch.

Started by the round's group before its workers, it serves their `init_process_group` with
TORCHELASTIC_USE_AGENT_STORE=True (every rank a client); its end while they run is the round's failure."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Any

import psutil
import pytest

from node_agent.workers.failures import store_failure
from node_agent.workers.group import WorkerGroup
from node_agent.workers.launch import STORE_RANK, WorkerLaunch
from node_agent.workers.warm.store_host import READY, SCRIPT
from tests.e2e.harness import pid_gone
from tests.integration.worker_support import LIMIT, RecordingConsole
from tests.ports import free_port

ENV = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
ALLREDUCE = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
print("sum", int(t.item()), flush=True)
dist.destroy_process_group()
"""


def store_hosts(port: int) -> list[int]:
    """The pids of this process's children hosting a store on `port`."""
    found = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):      # one that ended meanwhile, or a zombie
            if child.cmdline()[-2:] == [SCRIPT, str(port)]:
                found.append(child.pid)
    return found


def store(port: int, argv: list[str] | None = None) -> WorkerLaunch:
    return WorkerLaunch(local_rank=STORE_RANK, rank=STORE_RANK, argv=argv or [sys.executable, "-u", SCRIPT, str(port)],
                        env={**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}, log_dir=None,
                        prefix="[store] ", prefix_all=True)


def worker(rank: int, port: int, argv: list[str]) -> WorkerLaunch:
    env = {**ENV, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True", "GLOO_SOCKET_IFNAME": "lo"}
    return WorkerLaunch(local_rank=rank, rank=rank, argv=[sys.executable, "-u", *argv], env=env, log_dir=None,
                        prefix=f"[{rank}] ", prefix_all=True)


async def test_the_workers_rendezvous_on_the_store_host_which_the_stop_ends(tmp_path) -> None:
    pytest.importorskip("torch")
    script = tmp_path / "allreduce.py"
    script.write_text(ALLREDUCE)
    port = free_port()
    console = RecordingConsole()
    group = WorkerGroup([worker(r, port, [str(script)]) for r in range(2)], stop_timeout=5, console=console,
                        store=store(port))
    try:
        await group.start()
        exits = await asyncio.wait_for(group.wait(), LIMIT * 4)
        assert sorted(e.exitcode for e in exits) == [0, 0], "\n".join(console.lines("stderr"))
        assert sorted(console.lines("stdout")) == ["[0] sum 3", "[1] sum 3", f"[store] {READY} {port}"]
        [store_pid] = store_hosts(port)                   # the host outlives the workers, until the stop
        assert not await asyncio.to_thread(pid_gone, store_pid, 0)
        # On MASTER_ADDR alone (TCPStore's own socket listens on every interface)
        assert {c.laddr.ip for c in psutil.Process(store_pid).net_connections("tcp") if c.status == "LISTEN"} \
            == {"127.0.0.1"}
    finally:
        await group.stop()
    assert await asyncio.to_thread(pid_gone, store_pid, LIMIT)


async def test_a_store_host_that_ends_while_the_workers_run_fails_the_round(tmp_path) -> None:
    sleeper = tmp_path / "sleep.py"
    sleeper.write_text("import time\ntime.sleep(600)\n")
    port = free_port()
    gone = store(port, [sys.executable, "-c", "import sys; sys.exit(0)"])   # even a clean end leaves no store
    group = WorkerGroup([worker(0, port, [str(sleeper)])], stop_timeout=5, console=RecordingConsole(), store=gone)
    try:
        await group.start()
        (failed,) = await asyncio.wait_for(group.wait(), LIMIT)
        assert failed.local_rank == STORE_RANK and failed.exitcode == 0
        reported = store_failure(failed, rank=4, host="h", node_id="n")
        assert (reported.local_rank, reported.rank, reported.exitcode, reported.reason) == (0, 4, 1, "store exited")
        assert f"the round's c10d store, hosted by this node's agent (pid {failed.pid}), exited with status 0" \
            in reported.message
    finally:
        await group.stop(signal.SIGKILL)
    for pid in group.pids:
        assert await asyncio.to_thread(pid_gone, pid, LIMIT)


def said_in(path: Any, text: str) -> str:
    """The first line of the file at `path` holding `text` (torch's own warnings come before it), once written;
    AssertionError after LIMIT."""
    deadline = time.monotonic() + LIMIT
    while True:
        lines = path.read_text().splitlines()
        found = [line for line in lines if text in line]
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"{text!r} not said within {LIMIT}s: {lines[-5:]}"
        time.sleep(0.05)


def test_a_store_listens_on_every_interface_where_master_addr_is_a_name_or_not_here() -> None:
    from node_agent.workers.warm.store_host import listening
    assert listening("localhost", 0) is None and listening("0.0.0.0", 0) is None
    assert listening("192.0.2.1", 0) is None                  # TEST-NET-1: an address of no host here
    bound = listening("127.0.0.1", 0)
    assert bound is not None
    with bound:
        assert bound.getsockname()[0] == "127.0.0.1"


def test_a_store_filled_by_a_stranger_refuses_past_its_bound_and_serves_the_job_on(tmp_path) -> None:
    """The store keeps whatever anyone who reaches it sends: bounded, a flood's `set` is refused and the store lives,
    its job's keys and clients with it, instead of the host running out of memory."""
    pytest.importorskip("torch")
    from datetime import timedelta

    from torch.distributed import TCPStore

    from node_agent.workers.warm.store_host import MEMORY_MB, memory_budget
    said = tmp_path / "stderr"
    with open(said, "w") as err:
        host = psutil.Popen([sys.executable, "-u", SCRIPT, "0"], stdout=subprocess.PIPE, stderr=err, text=True,
                            env={**ENV, "MASTER_ADDR": "127.0.0.1", MEMORY_MB: "64"})
    try:
        port = int(host.stdout.readline().split()[-1])
        start = host.memory_info().rss
        job = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=LIMIT))
        job.set("job/key", b"1")
        stranger = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=LIMIT))
        blob = b"x" * (7 << 20)                  # torch's store takes values up to 8 MiB
        refused_at = None
        for i in range(40):                      # 280 MiB: past the bound of 64
            try:
                stranger.set(f"flood/{i}", blob)
            except RuntimeError:                 # torch's DistNetworkError: the store closed the connection
                refused_at = i
                break
        assert refused_at is not None and refused_at * 7 <= 64 + 8, refused_at
        assert host.is_running() and host.status() != psutil.STATUS_ZOMBIE
        assert host.memory_info().rss - start < (64 + 16) << 20
        assert f"{MEMORY_MB}=64" in said_in(said, "near its bound")   # the watch's, within a second of it
        job.set("job/next", b"2")                # the job's client and a new one go on
        again = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=LIMIT))
        assert again.get("job/key") == b"1" and again.get("job/next") == b"2"
    finally:
        host.kill()
        host.wait()
    assert memory_budget({}) == (1024, "")
    assert memory_budget({MEMORY_MB: "0"}) == (0, "")
    budget, problem = memory_budget({MEMORY_MB: "1G"})
    assert budget == 1024 and f"{MEMORY_MB}='1G' is not a whole number of MiB" in problem


def test_a_stranger_holding_the_store_hosts_descriptors_does_not_keep_the_rounds_workers_out() -> None:
    """torch's store accepts every connection and closes none: a stranger's idle ones, up to the store host's
    descriptor limit, kept the round's workers from connecting (their init failed: a restart used). The store host
    raises its soft limit to the hard one, so such a stranger needs that many connections, not a thousand."""
    pytest.importorskip("torch")
    import resource
    import socket
    from datetime import timedelta

    from torch.distributed import TCPStore

    soft, hard = 128, min(4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1])

    def low_limit() -> None:          # as an agent started with a soft limit of 1024 (a shell's, systemd's)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    host = psutil.Popen([sys.executable, "-u", SCRIPT, "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                        text=True, env={**ENV, "MASTER_ADDR": "127.0.0.1"}, preexec_fn=low_limit)
    idle: list[socket.socket] = []
    try:
        port = int(host.stdout.readline().split()[-1])
        assert host.rlimit(psutil.RLIMIT_NOFILE) == (hard, hard)
        for _ in range(soft + 64):                    # past the limit it was started with
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=LIMIT))
        job = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=LIMIT))
        job.set("job/key", b"1")
        assert job.get("job/key") == b"1"
    finally:
        for sock in idle:
            sock.close()
        host.kill()
        host.wait()
