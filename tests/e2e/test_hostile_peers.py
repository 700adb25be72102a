"""No peer can take a node down (issue 53): a real agent whose descriptors are few (RLIMIT_NOFILE 128, soft and
hard: it cannot raise it) under thousands of idle connections to its TLS port for copies and its witness port (held
longer than the TLS handshake's limit), and long lines, from 40 loopback addresses. It lives, its job goes on with
no restart, it answers a witness question once the flood is over, and its job ends as it would have; and a stranger
flooding a witness's port while the server is away makes no node fence."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time

import psutil
import pytest

from tests.e2e.certs import make_ca, make_server_cert
from tests.e2e.harness import SCRIPTS, Proc, child_env, job_view, open_files_limit, read_jsonl, wait_until

pytestmark = pytest.mark.e2e
WORKER = os.path.join(SCRIPTS, "memory_worker.py")


def listening_ports(pid: int) -> list[int]:
    """Its witness port and its TLS port for copies."""
    ports = sorted(c.laddr.port for c in psutil.Process(pid).net_connections("tcp") if c.status == "LISTEN")
    assert len(ports) == 2, ports
    return ports


def ask(port: int) -> bytes:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"rdzv-agent ask round=1\n")
        return s.recv(256)
    return b""


def test_a_flood_of_idle_connections_and_long_lines_takes_no_agent_down(cluster, tmp_path):
    ca = make_ca(str(tmp_path))
    cert, key = make_server_cert(str(tmp_path), ca)
    cluster.start_server("--tls-cert", cert, "--tls-key", key)
    cluster.ca = ca[0]
    argv = [*open_files_limit(128), sys.executable, "-m", "node_agent.main", "--endpoint",
            f"https://{cluster.endpoint()}", "--tls-ca", ca[0], "--tls-cert", cert, "--tls-key", key, "--nnodes", "1",
            "--nproc", "1", "--job-id", "flood", "--node-id", "n", "--max-restarts", "0", "--lease-timeout", "3",
            WORKER]
    agent = Proc(argv, child_env(TMPDIR=cluster.temp_dir(), OUT_DIR=str(tmp_path),
                                 WAIT_FILE=str(tmp_path / "done")), "agent")
    cluster.procs.append(agent)
    wait_until(lambda: (tmp_path / "rank0-attempt0.json").exists(), 60, lambda: f"the worker\n{agent.output}")
    assert psutil.Process(agent.pid).rlimit(psutil.RLIMIT_NOFILE) == (128, 128)
    ports = listening_ports(agent.pid)
    witness = next(p for p in ports if ask(p).startswith(b"rdzv-agent in-contact"))

    flood: list[socket.socket] = []
    began = time.monotonic()
    while time.monotonic() - began < 6.0:       # more than the handshake's limit: the first ones are let go
        for port in ports:                      # idle: no line, no ClientHello; held open
            s = socket.socket()
            s.bind((f"127.0.0.{2 + len(flood) % 30}", 0))
            s.settimeout(1)
            try:
                s.connect(("127.0.0.1", port))
                flood.append(s)
            except OSError:
                s.close()
        if len(flood) % 50 == 0:
            assert agent.popen.poll() is None, agent.output
            time.sleep(0.05)                    # a pace for the flood, as an attacker's
    for k in range(100):                        # a line of 2 MiB each
        with contextlib.suppress(OSError), socket.create_connection(
                ("127.0.0.1", witness), timeout=5, source_address=(f"127.0.0.{40 + k % 10}", 0)) as s:
            s.sendall(b"x" * (2 << 20) + b"\n")      # cut short once past the first line's bound: as it should be
    assert agent.popen.poll() is None, agent.output
    assert psutil.Process(agent.pid).num_fds() < 128
    for s in flood:
        s.close()
    answer = wait_until(lambda: ask(witness), 10, "a witness answer after the flood")
    assert answer.startswith(b"rdzv-agent in-contact round="), answer
    (tmp_path / "done").write_text("")
    assert agent.wait(60) == 0, agent.output
    assert job_view(cluster, "flood")["restart_count"] == 0


LOOP = os.path.join(SCRIPTS, "elastic_loop.py")


def test_a_stranger_flooding_a_witness_while_the_server_is_away_fences_nobody(cluster, tmp_path):
    """A node asks its round's witnesses when the server goes silent; a stranger holding every connection a
    witness's agent may have open (RLIMIT_NOFILE 128: 32) made it close the asker's connections unanswered, which
    counted as being cut off: the asker fenced its healthy workers, and the job spent a restart (or failed). Now a
    witness reached is no sign of a cut, and idle strangers make room: both nodes train on through the outage."""
    port = cluster.start_server()

    def agent(node: str, *prefix: str) -> Proc:
        argv = [*prefix, sys.executable, "-m", "node_agent.main", "--endpoint", cluster.endpoint(), "--nnodes", "2",
                "--nproc", "1", "--job-id", "away", "--node-id", node, "--max-restarts", "0", "--lease-timeout", "3",
                LOOP]
        proc = Proc(argv, child_env(TMPDIR=cluster.temp_dir(), OUT_DIR=str(tmp_path), STEP_SLEEP="0.1"), node)
        cluster.procs.append(proc)
        return proc

    a, b = agent("a"), agent("b", *open_files_limit(128))
    steps = lambda since: {r["pid"] for r in read_jsonl(tmp_path, "steps-") if r["kind"] == "step" and r["t"] > since}  # noqa: E731
    wait_until(lambda: len(steps(0)) == 2, 90, lambda: f"both workers stepping\n{a.output}\n{b.output}")
    workers = steps(0)
    witness = next(p for p in (c.laddr.port for c in psutil.Process(b.pid).net_connections("tcp")
                               if c.status == "LISTEN") if ask(p).startswith(b"rdzv-agent"))
    flood = []
    for _ in range(60):                          # idle, from one address: past b's cap of 32
        s = socket.create_connection(("127.0.0.1", witness), timeout=5, source_address=("127.0.0.2", 0))
        flood.append(s)
    try:
        cluster.server.popen.send_signal(signal.SIGKILL)
        cluster.server.popen.wait(10)
        killed = time.time()
        # Past the lease (3 s) and the fencing bound after it (2 s), with a margin: the same workers step on.
        wait_until(lambda: steps(killed + 8.0) == workers, 60,
                   lambda: f"the workers stepping 8 s into the outage\n{a.output}\n{b.output}")
        assert "fenced" not in a.output + b.output, a.output + b.output
        assert "workers keep running" in a.output, a.output
    finally:
        for s in flood:
            s.close()
    cluster.start_server(port=port)
    (tmp_path / "stop").write_text("")
    assert a.wait(90) == 0 and b.wait(90) == 0, a.output + b.output
    assert job_view(cluster, "away")["restart_count"] == 0
