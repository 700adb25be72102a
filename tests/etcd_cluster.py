"""A real etcd cluster for tests and benchmarks: Debian's `etcd` binary (`make etcd`), members on free
loopback ports with their data in a temporary folder, every process killed and the folder removed
by `close()` whatever happened.

Members can be killed (SIGKILL), stopped (SIGSTOP) and started again on their data, to take the
cluster through the faults the replicated server must ride out.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

from tests.ports import free_ports

ETCD = shutil.which("etcd") or "/usr/bin/etcd"


def etcd_available() -> bool:
    return os.path.exists(ETCD)


class EtcdCluster:
    def __init__(self, members: int = 3, base_dir: str | None = None) -> None:
        self.size = members
        self.dir = tempfile.mkdtemp(prefix="etcd-", dir=base_dir)
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.client_ports: list[int] = []
        self.peer_ports: list[int] = []

    # ---- the cluster ----

    def start(self, timeout: float = 30.0) -> EtcdCluster:
        for attempt in range(3):           # a free port taken between our check and etcd's bind: again
            ports = free_ports(2 * self.size)
            self.client_ports, self.peer_ports = ports[: self.size], ports[self.size:]
            for i in range(self.size):
                self.start_member(i)
            try:
                self.wait_healthy(range(self.size), timeout)
                return self
            except AssertionError:
                self.kill_all()
                if attempt == 2:
                    raise
                shutil.rmtree(self.dir, ignore_errors=True)
                os.makedirs(self.dir)
        return self

    @property
    def url(self) -> str:
        """The store URL for `rdzv-server --store`."""
        return "etcd://" + ",".join(f"127.0.0.1:{p}" for p in self.client_ports)

    def member_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.client_ports[i]}"

    def start_member(self, i: int) -> None:
        name = f"m{i}"
        initial = ",".join(f"m{j}=http://127.0.0.1:{p}" for j, p in enumerate(self.peer_ports))
        argv = [ETCD, "--name", name, "--data-dir", os.path.join(self.dir, name),
                "--listen-client-urls", self.member_url(i), "--advertise-client-urls", self.member_url(i),
                "--listen-peer-urls", f"http://127.0.0.1:{self.peer_ports[i]}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_ports[i]}",
                "--initial-cluster", initial, "--initial-cluster-state", "new",
                "--initial-cluster-token", os.path.basename(self.dir),
                "--auto-compaction-mode", "revision", "--auto-compaction-retention", "10000",
                "--logger", "zap", "--log-level", "error"]
        log = open(os.path.join(self.dir, f"{name}.log"), "ab")
        self.procs[i] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def kill_member(self, i: int) -> None:
        proc = self.procs.pop(i, None)
        if proc is not None:
            proc.kill()
            proc.wait(10)

    def kill_all(self) -> None:
        for i in list(self.procs):
            self.kill_member(i)

    def start_all(self, timeout: float = 30.0) -> None:
        for i in range(self.size):
            if i not in self.procs:
                self.start_member(i)
        self.wait_healthy(range(self.size), timeout)

    def pause_member(self, i: int) -> None:
        os.kill(self.procs[i].pid, signal.SIGSTOP)

    def resume_member(self, i: int) -> None:
        os.kill(self.procs[i].pid, signal.SIGCONT)

    def healthy(self, i: int) -> bool:
        try:
            with urllib.request.urlopen(self.member_url(i) + "/health", timeout=1) as resp:
                return json.loads(resp.read()).get("health") == "true"
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def wait_healthy(self, members: range | list[int], timeout: float = 30.0) -> None:
        """Wait until each member says it is healthy (it has a leader and answers)."""
        deadline = time.monotonic() + timeout
        for i in members:
            while not self.healthy(i):
                if time.monotonic() > deadline:
                    raise AssertionError(f"etcd member m{i} not healthy after {timeout}s:\n{self.log(i)}")
                time.sleep(0.1)     # polling a health route: no event announces it

    def log(self, i: int) -> str:
        try:
            with open(os.path.join(self.dir, f"m{i}.log"), errors="replace") as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    def close(self) -> None:
        self.kill_all()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
