"""One job across namespace hosts: a real `rdzv-server` on one host, real `node-agent`s on others,
gloo workers (scripts/train_loop.py) logging every step to OUT_DIR/HOST.jsonl.

The test process stays in the root namespace: it reads the worker logs from the shared file system,
sees every pid (the pid namespace is shared), and reads the server's JSON views through sockets made
inside the server's namespace (`Network.socket`).
"""
from __future__ import annotations

import datetime as dt
import glob
import http.client
import json
import os
import shutil
import sys
from pathlib import Path

from node_agent.workers import memory
from tests.e2e.harness import ROOT, Proc, child_env
from tests.multihost.netns import Network

TRAIN_LOOP = os.path.join(ROOT, "tests", "multihost", "scripts", "train_loop.py")
LEASE_S = 5.0          # the agent's default --lease-timeout, passed explicitly so bounds derive from it
# Within the namespaces every host has the same host name, which resolves to 127.0.0.1: gloo must be
# told which interface carries the host's address. (Issue 12 item 5: the agent will set this itself.)
GLOO_IFNAME = "eth0"


class _NsHTTPConnection(http.client.HTTPConnection):
    def __init__(self, net: Network, host_ns: str, addr: str, port: int, timeout: float) -> None:
        super().__init__(addr, port, timeout=timeout)
        self._net = net
        self._host_ns = host_ns

    def connect(self) -> None:
        self.sock = self._net.socket(self._host_ns)
        self.sock.settimeout(self.timeout)
        self.sock.connect((self.host, self.port))


def parse_time(iso: str) -> float:
    return dt.datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


class MultiHostJob:
    """A server host, agent hosts and one job id; `close()` kills every process it started."""

    def __init__(self, net: Network, out: Path, job_id: str, *, server_host: str = "server") -> None:
        self.net = net
        self.out = out
        self.job_id = job_id
        self.server_host = server_host
        self.port = 0
        self.server: Proc | None = None
        self.agents: dict[str, Proc] = {}
        self._procs: list[Proc] = []

    # --------------------------------------------------------------------------------- processes

    def start_server(self, listen: str | None = None) -> int:
        """`rdzv-server` on the server host, on that host's address unless `listen` says otherwise."""
        argv = [sys.executable, "-m", "rdzv_server.cli", "--host", listen or self.server_addr, "--port", "0",
                "--state-dir", "none"]
        self.server = self._start(self.server_host, argv, "server", {})
        self.port = int(self.server.wait_for_line(r"rdzv-server listening on http://\S+:(\d+)", 30).group(1))
        return self.port

    @property
    def server_addr(self) -> str:
        return self.net.addr(self.server_host)

    def endpoint(self) -> str:
        return f"{self.server_addr}:{self.port}"

    def start_agent(self, host: str, *, nnodes: str = "2:3", endpoint: str | None = None,
                    extra: tuple[str, ...] = (), gloo_ifname: str | None = GLOO_IFNAME, nproc: int = 1,
                    script: str = TRAIN_LOOP, env: dict[str, str] | None = None) -> Proc:
        """An agent on `host` running `script` (scripts/train_loop.py); `gloo_ifname=None` leaves
        GLOO_SOCKET_IFNAME unset; `env`: more for its workers."""
        argv = [sys.executable, "-m", "node_agent.main", "--endpoint", endpoint or self.endpoint(),
                "--nnodes", nnodes, "--nproc", str(nproc), "--job-id", self.job_id, "--node-id", host,
                "--max-restarts", "3", "--lease-timeout", f"{LEASE_S:g}", *extra, script]
        tmp = self.out / "tmp"          # where an agent killed at teardown leaves its run directory
        tmp.mkdir(exist_ok=True)
        env = {"HOST": host, "OUT_DIR": str(self.out), "TMPDIR": str(tmp), **(env or {})}
        if gloo_ifname is not None:
            env["GLOO_SOCKET_IFNAME"] = gloo_ifname
        proc = self._start(host, argv, host, env)
        self.agents[host] = proc
        return proc

    def _start(self, host: str, argv: list[str], name: str, env: dict[str, str]) -> Proc:
        full = child_env(**env)
        if "GLOO_SOCKET_IFNAME" not in env:
            full.pop("GLOO_SOCKET_IFNAME", None)
        proc = Proc(self.net.exec_argv(host, argv), full, name)
        self._procs.append(proc)
        return proc

    def close(self) -> None:
        """Every process, then the memory directories its agents kept (a SIGKILLed agent cannot remove its own:
        they would stay KEEP_S in /dev/shm)."""
        for proc in reversed(self._procs):
            proc.kill_all()
        for kept in glob.glob(os.path.join(memory.SHM, "node-agent-mem-*", glob.escape(self.job_id) + ".*")):
            shutil.rmtree(kept, ignore_errors=True)

    # ------------------------------------------------------------------------------- worker logs

    def records(self, host: str) -> list[dict]:
        path = self.out / f"{host}.jsonl"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:      # a line being written
                pass
        return out

    def steps(self, host: str, since: float = 0.0) -> list[dict]:
        return [r for r in self.records(host) if r["kind"] == "step" and r["t"] >= since]

    def worker_pids(self, host: str) -> list[int]:
        """Pids of the host's workers in the order they started (one per round with nproc 1)."""
        seen: list[int] = []
        for r in self.records(host):
            if r["pid"] not in seen:
                seen.append(r["pid"])
        return seen

    def training(self, hosts: list[str], world: int, since: float = 0.0,
                 old_pids: frozenset[int] = frozenset()) -> dict[str, dict] | None:
        """Each host's first full step (sum == world) at `world` after `since` by a worker not in
        `old_pids`, once every host has one; else None."""
        first: dict[str, dict] = {}
        for host in hosts:
            step = next((r for r in self.steps(host, since)
                         if r["world"] == world and r["sum"] == world and r["pid"] not in old_pids), None)
            if step is None:
                return None
            first[host] = step
        return first

    def describe_workers(self) -> str:
        lines = []
        for host in self.agents:
            recs = self.records(host)
            by_pid: dict[int, list[dict]] = {}
            for r in recs:
                by_pid.setdefault(r["pid"], []).append(r)
            for pid, rs in by_pid.items():
                kinds = [r["kind"] for r in rs]
                lines.append(f"  {host} pid {pid} world {rs[0]['world']} restart {rs[0]['restart']}: "
                             f"{kinds.count('step')} steps, last {rs[-1]['kind']} at {rs[-1]['t']:.1f}")
        return "\n".join(lines) or "  (no worker wrote anything)"

    # ----------------------------------------------------------------------------- server views

    def get(self, path: str, timeout: float = 5.0) -> dict:
        conn = _NsHTTPConnection(self.net, self.server_host, self.server_addr, self.port, timeout)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise AssertionError(f"GET {path}: HTTP {resp.status}: {body[:300]!r}")
            return json.loads(body)
        finally:
            conn.close()

    def view(self) -> dict | None:
        try:
            return self.get(f"/v1/jobs/{self.job_id}")
        except AssertionError:
            return None     # no agent has created the job yet

    def events(self) -> list[dict]:
        return self.get(f"/v1/jobs/{self.job_id}/events")["events"]

    def events_of(self, kind: str, since: float = 0.0) -> list[dict]:
        return [e for e in self.events() if e["kind"] == kind and parse_time(e["time"]) >= since]

    def history(self) -> str:
        return "\n".join(f"  {e['time']} {e['kind']}: {e['message']}" for e in self.events())

    def diagnosis(self) -> str:
        """Everything useful when a test fails: events, workers, the agents' last lines."""
        try:
            history = self.history()
        except (OSError, AssertionError) as exc:
            history = f"  (server not reachable: {exc})"
        tails = "\n".join(f"--- {name} ---\n" + "\n".join(p.lines[-15:]) for name, p in self.agents.items())
        return f"server events:\n{history}\nworkers:\n{self.describe_workers()}\nagents:\n{tails}"
