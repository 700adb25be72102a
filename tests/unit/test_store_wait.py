"""A worker waits for its round's agent-hosted c10d store to listen before torch connects (probe._store_listening):
torch's first connect refused sleeps its backoff (250-750 ms), the bimodal restart the demo showed."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest

from node_agent.training import probe
from node_agent.workers.environment import BOOT_DIR
from node_agent.workers.probes import ProbeFiles
from tests.ports import free_ports

ROOT = str(Path(__file__).resolve().parents[2])
LIMIT = 30.0
REFUSED = "is not yet listening"     # torch's own line (TORCH_DISTRIBUTED_DEBUG=DETAIL) when it retries


@pytest.fixture
def store_env(monkeypatch) -> int:
    port = free_ports(1)[0]
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    return port


def waiting(args: tuple, kwargs: dict) -> threading.Thread:
    thread = threading.Thread(target=probe._store_listening, args=(args, kwargs), daemon=True)
    thread.start()
    return thread


def test_waits_until_the_store_listens_then_returns(store_env):
    with socket.socket() as server:
        server.bind(("127.0.0.1", store_env))     # bound, not listening: connects are refused
        thread = waiting(("gloo",), {})
        thread.join(0.3)
        assert thread.is_alive(), "it returned while nothing listened"
        server.listen()
        thread.join(LIMIT)
        assert not thread.is_alive(), "it kept waiting once the store listened"
        server.settimeout(LIMIT)
        server.accept()[0].close()               # its connection: the one that found the store


@pytest.mark.parametrize("args, kwargs, env", [
    (("gloo", "tcp://127.0.0.1:1"), {}, {}),                  # the script's own init_method
    (("gloo",), {"init_method": "file:///tmp/x"}, {}),
    (("gloo",), {"store": object()}, {}),                    # the script's own store
    (("gloo", None, None, -1, -1, object()), {}, {}),
    (("gloo",), {}, {"TORCHELASTIC_USE_AGENT_STORE": "False"}),   # rank 0 hosts the store (torchrun's default)
    (("gloo",), {}, {"MASTER_PORT": "not-a-port"}),
])
def test_no_wait_where_the_agent_hosts_no_store(store_env, monkeypatch, args, kwargs, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    thread = waiting(args, kwargs)
    thread.join(LIMIT)
    assert not thread.is_alive()


def test_the_wait_is_bounded_by_the_calls_timeout(store_env):
    thread = waiting(("gloo",), {"timeout": timedelta(seconds=0.05)})
    thread.join(LIMIT)
    assert not thread.is_alive(), "it waited past the call's own timeout"


def test_an_unresolvable_name_is_left_to_torch(store_env, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "no-such-host.invalid")
    thread = waiting(("gloo",), {})
    thread.join(LIMIT)
    assert not thread.is_alive()


LATE_STORE = """import os, sys, threading, time
import torch.distributed as dist
from torch.distributed import TCPStore
port = int(os.environ["MASTER_PORT"])
def late():                    # the store host of a node that stops its old workers first
    time.sleep(0.3)
    global store
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
threading.Thread(target=late).start()
dist.init_process_group("gloo", world_size=1, rank=0)
print("grouped", flush=True)
dist.destroy_process_group()
os._exit(0)
"""


@pytest.mark.parametrize("probed", [True, False])
def test_torch_never_retries_under_the_probe(tmp_path, probed):
    """With the probe, torch's first connect finds the store; without it (the control: the case is real) torch's
    first connect is refused and it sleeps its backoff."""
    files = ProbeFiles.in_dir(str(tmp_path), 0)
    files.create()
    script = tmp_path / "late.py"
    script.write_text(LATE_STORE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_ports(1)[0]), TORCHELASTIC_USE_AGENT_STORE="True",
               TORCH_CPP_LOG_LEVEL="INFO", TORCH_DISTRIBUTED_DEBUG="DETAIL", OMP_NUM_THREADS="1",
               PYTHONPATH=(BOOT_DIR + os.pathsep if probed else "") + ROOT)
    if probed:
        env[probe.ENV] = files.env()
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert "grouped" in done.stdout, done.stderr[-3000:]
    assert (REFUSED in done.stderr) != probed, done.stderr[-3000:]


def test_a_long_wait_is_said_once(store_env, monkeypatch, capsys):
    monkeypatch.setattr(probe, "STORE_SAY_S", 0.05)
    thread = waiting(("gloo",), {"timeout": timedelta(seconds=0.3)})
    thread.join(LIMIT)
    assert not thread.is_alive()
    said = capsys.readouterr().err
    assert said.count("is not listening after 0.05s") == 1 and f"127.0.0.1:{store_env}" in said, said
