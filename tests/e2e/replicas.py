"""Replicated servers for end-to-end tests: a real etcd cluster (tests/etcd_cluster.py) and
rdzv-server replicas on it, each a real process on 127.0.0.1; everything killed at `close()`."""
from __future__ import annotations

import json
import os
import signal
import sys
import urllib.error
import urllib.request

from tests.e2e.harness import Cluster, Proc, child_env, wait_until
from tests.etcd_cluster import EtcdCluster, etcd_available


class Replicas:
    # A 4 s leader lease (renewed every second, 1 s a request): with 2 s a loaded machine's stalled renewal could
    # depose a leader under a test that counts takeovers.
    def __init__(self, cluster: Cluster, tmp_path, members: int = 3, leader_ttl: int = 4) -> None:
        assert etcd_available(), "etcd is not installed: run `make etcd` (Debian's etcd-server package)"
        self.cluster = cluster
        self.etcd = EtcdCluster(members, base_dir=str(tmp_path)).start()
        self.leader_ttl = leader_ttl
        self.servers: list[Proc | None] = []
        self.ports: list[int] = []

    def start(self, n: int = 2) -> None:
        for _ in range(n):
            self.servers.append(None)
            self.ports.append(0)
            self.restart(len(self.servers) - 1)

    def restart(self, i: int) -> None:
        """Start replica i (again, on its port once it has one)."""
        proc = Proc([sys.executable, "-m", "rdzv_server.cli", "--host", "127.0.0.1", "--port", str(self.ports[i]),
                     "--store", self.etcd.url, "--leader-ttl", str(self.leader_ttl), "--log-level", "info"],
                    child_env(), f"replica-{i}")
        self.cluster.procs.append(proc)
        found = proc.wait_for_line(r"listening on https?://[^:]+:(\d+)", 30)
        self.servers[i], self.ports[i] = proc, int(found.group(1))

    @property
    def endpoints(self) -> str:
        return ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.ports[i]}"

    def ready(self, i: int) -> bool:
        try:
            with urllib.request.urlopen(self.url(i) + "/readyz", timeout=2) as resp:
                return resp.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def leader(self, timeout: float = 30.0, besides: int | None = None) -> int:
        """The replica that serves (waits for an election)."""
        return wait_until(lambda: next((i + 1 for i in range(len(self.ports)) if i != besides and self.ready(i)), 0),
                          timeout, "a replica to lead") - 1

    def get(self, i: int, path: str) -> dict:
        with urllib.request.urlopen(self.url(i) + path, timeout=10) as resp:
            return json.load(resp)

    def signal(self, i: int, sig: signal.Signals) -> None:
        proc = self.servers[i]
        assert proc is not None
        os.kill(proc.pid, sig)
        if sig == signal.SIGKILL:
            proc.popen.wait(10)

    def close(self) -> None:
        for proc in self.servers:
            if proc is not None:
                try:
                    os.kill(proc.pid, signal.SIGCONT)     # a stopped process cannot be reaped otherwise
                except ProcessLookupError:
                    pass
        self.cluster.close()
        self.etcd.close()
