"""Elastic events with default settings, over real processes on loopback (issue 4 targets):

- agent SIGKILL -> survivors' workers running at the smaller world size   (<= 2 s)
- member lost at max -> promoted spare's workers running, after the loss is noticed (<= 1 s)
- scale-up 1 -> 2 nodes: new agent launched -> both at the new world size  (<= 1 s)

Run: .venv/bin/python benchmarks/bench_elastic.py [--repeat 3]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks._server import running_server  # noqa: E402

WORKER = os.path.join(ROOT, "benchmarks", "scripts", "world_worker.py")


class Run:
    def __init__(self, port: int, job: str, log: str) -> None:
        self.port, self.job, self.log = port, job, log
        self.agents: dict[str, subprocess.Popen] = {}

    def agent(self, name: str, nnodes: str) -> None:
        env = dict(os.environ, PYTHONPATH=ROOT, BENCH_LOG=self.log, NODE=name)
        self.agents[name] = subprocess.Popen(
            [sys.executable, "-m", "node_agent.main", "--endpoint", f"127.0.0.1:{self.port}", "--nnodes", nnodes,
             "--nproc", "1", "--job-id", self.job, "--node-id", name, WORKER],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def starts(self) -> list[tuple[int, int, str, float]]:
        if not os.path.exists(self.log):
            return []
        with open(self.log) as f:
            return [(int(p[1]), int(p[2]), p[3], float(p[4])) for p in (ln.split() for ln in f) if p[0] == "start"]

    def wait_world(self, world: int, after: float = 0.0, timeout: float = 60.0) -> float:
        """Time the last worker of a world of `world` started after `after` (waits for it)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            got = [s for s in self.starts() if s[1] == world and s[3] > after]
            if len(got) >= world:
                return max(s[3] for s in got)
            time.sleep(0.01)
        raise RuntimeError(f"world {world} never came up: {self.starts()}")

    def events(self) -> list[dict]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/jobs/{self.job}/events") as r:
            return json.load(r)["events"]

    def close(self) -> None:
        for p in self.agents.values():
            if p.poll() is None:
                p.kill()
            p.wait()


def parse_iso(text: str) -> float:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def kill_agent(port: int, k: int, tmp: str) -> float:
    run = Run(port, f"kill-{k}", os.path.join(tmp, f"kill-{k}.log"))
    try:
        for n in ("a", "b", "c"):
            run.agent(n, "2:3")
        run.wait_world(3)
        t0 = time.time()
        run.agents["c"].send_signal(signal.SIGKILL)
        return run.wait_world(2, after=t0) - t0
    finally:
        run.close()


def spare_promotion(port: int, k: int, tmp: str) -> float:
    run = Run(port, f"spare-{k}", os.path.join(tmp, f"spare-{k}.log"))
    try:
        run.agent("a", "2:2")
        run.agent("b", "2:2")
        first = run.wait_world(2)
        run.agent("s", "2:2")
        while not any(e["kind"] == "node_spare" for e in run.events()):
            time.sleep(0.01)
        run.agents["b"].send_signal(signal.SIGKILL)
        promoted = run.wait_world(2, after=first + 0.001)
        lost = next(parse_iso(e["time"]) for e in run.events() if e["kind"] == "node_lost")
        return promoted - lost
    finally:
        run.close()


def scale_up(port: int, k: int, tmp: str) -> float:
    run = Run(port, f"scale-{k}", os.path.join(tmp, f"scale-{k}.log"))
    try:
        run.agent("a", "1:2")
        run.wait_world(1)
        t0 = time.time()
        run.agent("b", "1:2")
        return run.wait_world(2, after=t0) - t0
    finally:
        run.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-elastic-")
    results: dict[str, list[float]] = {"kill_to_smaller_world_s": [], "loss_to_spare_running_s": [],
                                       "scale_up_1_to_2_s": []}
    with running_server("--log-level", "warning") as port:
        for k in range(args.repeat):
            for name, fn in (("kill_to_smaller_world_s", kill_agent), ("loss_to_spare_running_s", spare_promotion),
                             ("scale_up_1_to_2_s", scale_up)):
                v = fn(port, k, tmp)
                results[name].append(v)
                print(f"run {k}: {name} = {v:.3f}", flush=True)
    for name, vals in results.items():
        print(f"RESULT {name} median={statistics.median(vals):.3f} max={max(vals):.3f}")


if __name__ == "__main__":
    main()
