"""The torchrun plugin's agent store in a process of its own (node_agent/plugin/agent_store.py): real processes,
real torch. It serves the port torchrun's process made (published at join), is started again there when it ended,
and ends with torchrun's process."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from datetime import timedelta

import psutil
import pytest

from node_agent.workers.warm.store_host import MEMORY_MB, SCRIPT
from tests.e2e.harness import pid_gone, wait_until

torch_distributed = pytest.importorskip("torch.distributed")
LIMIT = 60.0


def client(port: int):
    return torch_distributed.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=LIMIT))


def test_the_store_runs_apart_bounded_and_comes_back_on_its_port() -> None:
    from node_agent.plugin.agent_store import AgentStore
    said: list[str] = []
    store = AgentStore("127.0.0.1", said.append)
    try:
        first = psutil.Process(store._process.pid)
        # Popen may return while the child is still execing (its cmdline reads empty for that moment)
        wait_until(lambda: first.cmdline() != [], LIMIT, "the store process's exec")
        assert SCRIPT in first.cmdline() and first.ppid() == os.getpid()
        c = client(store.port)
        c.set("k", b"1")
        assert c.get("k") == b"1"
        if os.environ.get(MEMORY_MB) != "0":  # bounded, as node-agent's (once torch's store is up)
            wait_until(lambda: first.rlimit(psutil.RLIMIT_DATA)[0] != psutil.RLIM_INFINITY, LIMIT, "a memory bound")
        store.ensure()                       # serving: nothing to do
        assert said == [] and store._process.pid == first.pid
        first.kill()
        store._process.wait(LIMIT)
        store.ensure()                       # a round needs it: started again on the published port
        assert said and f"ended with status {-signal.SIGKILL}" in said[0] and f"port {store.port}" in said[0]
        again = client(store.port)
        again.set("k2", b"2")
        assert again.get("k2") == b"2"
    finally:
        pid = store._process.pid
        store.close()
    assert pid_gone(pid, LIMIT)


def test_the_store_ends_with_a_parent_killed_outright(tmp_path) -> None:
    """torchrun's process may end by SIGKILL (no atexit): its store process notices and ends."""
    code = ("import sys, time; from node_agent.plugin.agent_store import AgentStore; "
            "s = AgentStore('127.0.0.1', print); print(s._process.pid, flush=True); time.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        pid = int(parent.stdout.readline())
        assert psutil.Process(pid).ppid() == parent.pid
    finally:
        parent.kill()
        parent.wait()
    assert pid_gone(pid, LIMIT)
