"""Real processes for end-to-end tests: a server and agents on 127.0.0.1, all cleaned up.

Every process a test starts (and every descendant seen while it ran) is killed at teardown,
even when the test fails. Ports come from the OS (port 0).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import psutil

from tests.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(ROOT, "tests", "e2e", "scripts")
# The suite's gloo scripts that run no optimizer step, so never import torch._dynamo: an agent of Cluster.agent
# started on one without --warm-preload/--warm-workers preloads the default less torch._dynamo (light_preload).
# It costs ~1.5 s of CPU in every such agent's warm interpreter before its node is ready, for nothing here; the
# default is the tests' own where it matters (test_warm, integration/test_warm_workers, the other scripts).
NO_DYNAMO_SCRIPTS = frozenset(os.path.join(SCRIPTS, name) for name in ("allreduce.py", "elastic_loop.py"))


class Proc:
    """A child process whose combined output is collected line by line in the background."""

    def __init__(self, argv: list[str], env: dict[str, str], name: str) -> None:
        self.name = name
        self.popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=env, start_new_session=True)
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.known: dict[int, psutil.Process] = {}

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def output(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    def wait_for_line(self, pattern: str, timeout: float = 60.0) -> re.Match:
        """Block until a line matching `pattern` is printed (the process's own announcement)."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    m = regex.search(line)
                    if m:
                        return m
                seen = len(self.lines)
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (self.popen.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(f"{self.name}: no line matching {pattern!r}; output:\n{self.output}")
                self._cond.wait(min(remaining, 0.5))

    def wait(self, timeout: float = 120.0) -> int:
        try:
            code = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} still running after {timeout}s; output:\n{self.output}") from None
        self._reader.join(5)
        return code

    def remember_descendants(self) -> set[int]:
        """Its descendants now, kept to be killed at the end (orphans of a SIGKILLed agent among them)."""
        try:
            for child in psutil.Process(self.pid).children(recursive=True):
                self.known.setdefault(child.pid, child)
        except psutil.NoSuchProcess:
            pass
        return set(self.known)

    def kill_all(self) -> None:
        """SIGKILL it and every descendant remembered. psutil checks each one's start time first: a pid the kernel
        gave to another process since (the suite runs as root) is left alone."""
        self.remember_descendants()
        self.popen.kill()                            # nothing once reaped
        for child in self.known.values():
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass


def light_preload(args: tuple[str, ...]) -> tuple[str, ...]:
    """--warm-preload with what the agent would preload for a NO_DYNAMO_SCRIPTS script in `args` but torch._dynamo;
    () where none is there or the test chose the warm workers' flags itself."""
    script = next((str(a) for a in args if str(a) in NO_DYNAMO_SCRIPTS), None)
    if script is None or any(str(a).startswith(("--warm-preload", "--warm-workers", "--warm_")) for a in args):
        return ()
    from node_agent.settings import DEFAULT_PRELOAD
    from node_agent.workers.warm.eligible import script_preloads
    found = script_preloads(script, module=False, cwd=ROOT, path0=SCRIPTS)
    return "--warm-preload", ",".join(dict.fromkeys([*(m for m in DEFAULT_PRELOAD if m != "torch._dynamo"), *found]))


def child_env(**extra: str | None) -> dict[str, str]:
    """The environment a test's process gets: ours (OMP_NUM_THREADS=1 among it: tests/conftest.py), the checkout on
    PYTHONPATH, and `extra` (None: unset)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


class Cluster:
    """One server plus any number of agents; `close()` kills everything that is left."""

    def __init__(self, tmp_path) -> None:
        self.tmp = tmp_path
        self.procs: list[Proc] = []
        self.server: Proc | None = None
        self.port = 0
        self.scheme = "http"
        self.token: str | None = None        # sent with get() when set
        self.ca: str | None = None           # verifies get() over https

    def temp_dir(self) -> str:
        """The TMPDIR of the processes this test starts. An agent without --log-dir makes its run
        directory there and removes it when it exits, but one killed at teardown (SIGKILL) cannot: its
        directory then stays in the test's tmp_path, not in the session's temp dir (tests/conftest.py)."""
        path = os.path.join(str(self.tmp), "tmp")
        os.makedirs(path, exist_ok=True)
        return path

    def start_server(self, *extra: str, port: int | None = None, prefix: tuple[str, ...] = ()) -> int:
        """Start (or restart) the server; its state dir is the same for the whole test unless given. Its port is
        one below the kernel's ephemeral range (tests/ports.py): a test that restarts it on the same port would
        find a port the kernel picked taken meanwhile by some process's client socket or bind(0). `prefix`: a
        command that runs it (one that sets its limits, say)."""
        port = free_port() if port is None else port
        if not any(arg.startswith("--state-dir") for arg in extra):
            extra = (*extra, "--state-dir", os.path.join(str(self.tmp), "server-state"))
        self.server = Proc([*prefix, sys.executable, "-m", "rdzv_server.cli", "--host", "127.0.0.1", "--port",
                            str(port), *extra], child_env(TMPDIR=self.temp_dir()), "server")
        self.procs.append(self.server)
        found = self.server.wait_for_line(r"listening on (https?)://[^:]+:(\d+)", 30)
        self.scheme, self.port = found.group(1), int(found.group(2))
        return self.port

    def agent(self, *args: str, name: str = "agent", env: dict[str, str | None] | None = None) -> Proc:
        argv = [sys.executable, "-m", "node_agent.main", *light_preload(args), *args]
        proc = Proc(argv, child_env(**{"TMPDIR": self.temp_dir(), **(env or {})}), name)
        self.procs.append(proc)
        return proc

    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def get(self, path: str) -> dict:
        request = urllib.request.Request(f"{self.scheme}://127.0.0.1:{self.port}{path}")
        if self.token is not None:
            request.add_header("Authorization", f"Bearer {self.token}")
        context = ssl.create_default_context(cafile=self.ca) if self.ca else None
        with urllib.request.urlopen(request, timeout=10, context=context) as resp:
            return json.load(resp)

    def close(self) -> None:
        for p in reversed(self.procs):
            p.kill_all()


def read_records(directory) -> list[dict]:
    """JSON lines written by the test worker scripts."""
    out = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".json"):
            with open(os.path.join(directory, name)) as f:
                out.append(json.load(f))
    return out


def pid_gone(pid: int, timeout: float) -> bool:
    """Whether the process ended within `timeout`: gone, or a zombie. An orphan's zombie waits for
    init to reap it, which under load can take longer than the test's whole limit."""
    deadline = time.monotonic() + timeout
    try:
        proc = psutil.Process(pid)
        while True:
            try:
                proc.wait(max(0.0, min(0.05, deadline - time.monotonic())))   # reaps it if it is our child
                return True
            except psutil.TimeoutExpired:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    return True
                if time.monotonic() >= deadline:
                    return False
    except psutil.NoSuchProcess:
        return True


def open_files_limit(n: int) -> tuple[str, ...]:
    """A command prefix that runs the rest of its command line at RLIMIT_NOFILE `n`, soft and hard (as util-linux's
    prlimit would): the process cannot raise it."""
    return (sys.executable, "-c", f"import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, ({n}, {n})); "
                                  "os.execv(sys.argv[1], sys.argv[1:])")


def reply_unread(pid: int, port: int) -> bool:
    """Whether bytes from 127.0.0.1:`port` wait unread in a TCP socket of process `pid` (a stopped agent's socket
    holding the server's answer to its poll: /proc's per-socket receive queue)."""
    try:
        inodes = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        lines = open(f"/proc/{pid}/net/tcp").read().splitlines()[1:]
    except OSError:
        return False
    for line in lines:
        f = line.split()
        remote_port, rx_queue = int(f[2].split(":")[1], 16), int(f[4].split(":")[1], 16)
        if remote_port == port and rx_queue > 0 and f"socket:[{f[9]}]" in inodes:
            return True
    return False


# ---------------------------------------------------------------------------------------------- waits


def wait_until(predicate, timeout: float, what, interval: float = 0.1):
    """Poll `predicate` until it returns something truthy (returned) or fail the test at `timeout`.

    For conditions with no event to block on (a server status, files from workers). `what` says
    what was awaited; a callable is called at the deadline, so the message can show the state then.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            text = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout:g}s waiting for {text}")
        time.sleep(interval)


def shard_resumes(directory, since: float) -> dict[int, tuple[int, str, str]]:
    """benchmarks/scripts/shard_train.py's OUT_DIR/resumed.txt: rank -> (step, source, "ok" when it loaded its own
    shard) for each rank started after `since` (the last such start of each rank)."""
    found: dict[int, tuple[int, str, str]] = {}
    path = os.path.join(directory, "resumed.txt")
    if os.path.exists(path):
        with open(path) as f:
            for p in (ln.split() for ln in f):
                if len(p) == 6 and float(p[0]) > since:
                    found[int(p[1])] = (int(p[2]), p[3], p[4])
    return found


def read_jsonl(directory, prefix: str) -> list[dict]:
    """Every JSON line in DIR/PREFIX*.jsonl, oldest first by its "t"; a torn last line is skipped.

    Files are named by pid, and pids wrap: file order is not the order the processes ran in."""
    out = []
    for name in sorted(os.listdir(directory)):
        if name.startswith(prefix) and name.endswith(".jsonl"):
            with open(os.path.join(directory, name)) as f:
                for line in f:
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        pass
    out.sort(key=lambda rec: rec.get("t", 0.0))
    return out


ROUND_LINE = re.compile(
    r"\[node-agent (?P<node>\S+)\] round (?P<round>\d+): group rank (?P<group_rank>\d+)/(?P<group_world>\d+), "
    r"ranks (?P<first>\d+)\.\.(?P<last>\d+) of world size (?P<world>\d+), master (?P<master_addr>.+):"
    r"(?P<master_port>\d+), restart count (?P<restart>\d+)/(?P<max_restarts>\d+)")


def announced_rounds(proc: Proc) -> list[dict]:
    """The rounds an agent announced (one line per spawn), in order, as dicts of ints/strings."""
    with proc._cond:
        lines = list(proc.lines)
    out = []
    for line in lines:
        m = ROUND_LINE.search(line)
        if m:
            d = m.groupdict()
            out.append({k: (v if k in ("node", "master_addr") else int(v)) for k, v in d.items()})
    return out


def job_view(cluster: Cluster, job_id: str, missing_ok: bool = False) -> dict | None:
    """GET /v1/jobs/ID; with missing_ok, None while no agent has created the job yet."""
    try:
        return cluster.get(f"/v1/jobs/{job_id}")
    except urllib.error.HTTPError as exc:
        if missing_ok and exc.code == 404:
            return None
        raise


def job_events(cluster: Cluster, job_id: str) -> list[dict]:
    return cluster.get(f"/v1/jobs/{job_id}/events")["events"]


class Gate:
    """Holds an agent "preparing": its warm interpreter's last preload (`gated`, in `directory`) reads a FIFO, so
    its imports end when the test opens it. `flags(script)`/`env` for the agent; `opened()` in a wait_until."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.fifo = os.path.join(directory, "gate")
        os.mkfifo(self.fifo)
        with open(os.path.join(directory, "gated.py"), "w") as f:
            f.write(f"import os\nif os.environ.get('GATED'):\n    with open({self.fifo!r}) as f:\n        f.read()\n")
        self.env = {"GATED": "1", "PYTHONPATH": ROOT + os.pathsep + directory}

    def flags(self, script: str) -> tuple[str, str]:
        """--warm-preload with what the agent would preload for `script` (its imports), `gated` last."""
        from node_agent.settings import DEFAULT_PRELOAD
        from node_agent.workers.warm.eligible import script_preloads
        found = script_preloads(script, module=False, cwd=ROOT, path0=os.path.dirname(script))
        return "--warm-preload", ",".join(dict.fromkeys([*DEFAULT_PRELOAD, *found, "gated"]))

    def opened(self) -> bool:
        """Whether a reader waits on the FIFO: it is told to go (its imports end), else False (none yet)."""
        try:
            fd = os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:             # ENXIO: nobody reads it yet
            return False
        try:
            os.write(fd, b"go")
        finally:
            os.close(fd)
        return True
