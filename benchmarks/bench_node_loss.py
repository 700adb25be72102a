"""Issue 46's targets: a lost node costs one snapshot. Real rdzv-server and node-agents on loopback (each node its
own failure domain and memory directory; a 3 s lease and a 1 s last call), 2 gloo workers per node running
benchmarks/scripts/shard_train.py (32 MB of state per rank, a snapshot every 5 steps of about 0.2 s, to disk
every 50).

  --lost N        3 x 2 + 1 spare: after step 27 (or 32, 37, ... once the spare is ready) the agent of group rank 1
                  SIGKILLed (its workers die with it) and its memory directory removed; alternated with a worker
                  SIGKILLed at the same step (a crash): the step and source each rank resumes from (memory / disk /
                  scratch), whether each loaded its own shard, and kill -> every rank stepping again
  --pair N        3 x 2 + 2 spares, group ranks 1 and 2 lost together (1's copies were on 2): every rank must fall
                  back to disk, said once
  --cost N        3 x 2, 60 s each with copies on (--replicas 1) and off (--replicas 0), alternated: median step
                  time, and the bytes copied
  --netns N       the --lost case with each node a network-namespace host (root) and that host's link cut (no FIN:
                  found by its 5 s lease) instead of its agent killed
  --replicas K    K for the runs (default 1)

Run: .venv/bin/python benchmarks/bench_node_loss.py [--lost N] [--pair N] [--cost N] [--out FILE]
     (make bench-node-loss)
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks import bench_places as places  # noqa: E402
from benchmarks._server import running_server  # noqa: E402
from benchmarks.bench_places import wait  # noqa: E402
from node_agent.workers.memory import dir_name  # noqa: E402

SCRIPT = os.path.join(ROOT, "benchmarks", "scripts", "shard_train.py")
KILL_AFTER = 27      # the first step at or after it two steps past a snapshot (27, 32, ...: spares ready first)


class Job(places.Job):
    """bench_places' job (its agents, their logs, stop), running shard_train.py, each node its failure domain."""

    def __init__(self, port: int, job: str, out: str, nnodes: str, extra: tuple[str, ...] = ()) -> None:
        super().__init__(port, job, out, nnodes)
        self.extra = extra

    def start(self, node: str) -> None:
        env = dict(os.environ, PYTHONPATH=ROOT, OUT_DIR=self.out, NODE=node)
        with open(os.path.join(self.out, f"agent-{node}.log"), "w") as log:
            self.agents[node] = subprocess.Popen(
                [sys.executable, "-m", "node_agent.main", "--endpoint", f"127.0.0.1:{self.port}", "--nnodes",
                 self.nnodes, "--nproc", "2", "--job-id", self.job, "--node-id", node, "--max-restarts", "5",
                 "--failure-domain", f"rack-{node}", *places.FAST, *self.extra, SCRIPT],
                env=env, cwd=self.out, stdout=log, stderr=subprocess.STDOUT)

    def steps(self) -> list[tuple[float, int, int, int, int, str]]:  # type: ignore[override]
        """(time, step, restart, world, rank, node) of every step logged."""
        rows = []
        for name in os.listdir(self.out):
            if name.startswith("steps-"):
                node = name.split("-")[1]
                with open(os.path.join(self.out, name)) as f:
                    rows += [(float(p[0]), int(p[1]), int(p[2]), int(p[3]), int(p[4]), node)
                             for p in (ln.split() for ln in f) if len(p) == 5]
        return rows

    def resumed(self, since: float) -> dict[int, list[str]]:
        """rank -> [step, source, ok, newest held] as each rank started after `since` resumed."""
        return {int(p[1]): p[2:] for p in _started(self, since)}

    def log(self, node: str) -> str:
        with open(os.path.join(self.out, f"agent-{node}.log")) as f:
            return f.read()


def group_rank_of(job: Job, node: str) -> int:
    """A node's group rank in the first round: its ranks are 2g and 2g+1."""
    ranks = {r for _, _, restart, _, r, n in job.steps() if n == node and restart == 0}
    return min(ranks) // 2


def forget_memory(job: str, node: str) -> int:
    """Remove a SIGKILLed agent's memory directory (its host's memory is gone with it); how many went."""
    path = os.path.join(f"/dev/shm/node-agent-mem-{os.getuid()}", dir_name(job, node))
    if not os.path.isdir(path):
        return 0
    shutil.rmtree(path, ignore_errors=True)
    return 1


def loss_run(port: int, i: int, lose: tuple[int, ...], crash: bool, extra: tuple[str, ...]) -> dict:
    kind = "crash" if crash else f"lost{len(lose)}"
    with _workdir() as out:
        job = Job(port, f"{kind}-{i}", out, "2:3", extra)
        try:
            for n in ("a", "b", "c"):
                job.start(n)
            wait(lambda: len({r for *_, r, _ in job.steps()}) == 6, 120, "the first world")
            for spare in ("s", "t")[:len(lose)]:
                job.start(spare)
                wait(lambda: "ready after" in job.log(spare), 60, f"the spare {spare}")  # noqa: B023 (waited here)
            now = max((s for _, s, *_ in job.steps()), default=0)
            target = max(KILL_AFTER, now + 1 + (2 - (now + 1)) % 5)
            wait(lambda: max((s for _, s, *_ in job.steps()), default=0) >= target, 120, f"step {target}")
            killed_at = time.time()
            by_rank = {n: group_rank_of(job, n) for n in ("a", "b", "c")}
            victims = [n for n, g in by_rank.items() if g in lose]
            if crash:
                with open(os.path.join(out, f"pid-{victims[0]}-0")) as f:
                    os.kill(int(f.read()), signal.SIGKILL)
            else:
                for n in victims:
                    job.agents[n].send_signal(signal.SIGKILL)
                for n in victims:
                    job.agents[n].wait()
                    forget_memory(job.job, n)
            again = wait(lambda: len(job.resumed(killed_at)) == 6 and _stepping(job, killed_at), 120,
                         "every rank again")
            assert again
            resumed = job.resumed(killed_at)
            first = _stepping(job, killed_at)
            job.stop()
            return {"kind": kind, "run": i, "victims": victims, "killed_after_step": target,
                    "steps": sorted({int(v[0]) for v in resumed.values()}),
                    "sources": sorted({v[1] for v in resumed.values()}),
                    "own_shards": sum(v[2] == "ok" for v in resumed.values()),
                    "stepping_again_s": round(max(first.values()) - killed_at, 2) if first else None,
                    "fetched": [ln for ln in job.log("s").splitlines() if "snapshots" in ln][:1],
                    "none_left_said": sum("no copy of" in e["message"] for e in _events(port, job.job))}
        finally:
            for a in job.agents.values():
                if a.poll() is None:
                    a.kill()
                    a.wait()


def _events(port: int, job: str) -> list[dict]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/jobs/{job}/events", timeout=10) as resp:
        return list(json.load(resp)["events"])


def _started(job: Job, since: float) -> list[list[str]]:
    """The resumed.txt lines of workers started after `since`."""
    with contextlib.suppress(FileNotFoundError), open(os.path.join(job.out, "resumed.txt")) as f:
        return [p for p in (ln.split() for ln in f) if len(p) == 6 and float(p[0]) > since]
    return []


@contextlib.contextmanager
def _workdir() -> Iterator[str]:
    """A run's directory: removed afterwards unless $BENCH_NODE_LOSS_KEEP is set (then kept and named)."""
    if os.environ.get("BENCH_NODE_LOSS_KEEP"):
        out = tempfile.mkdtemp(prefix="bench-node-loss-")
        print(f"run directory: {out}", flush=True)
        yield out
    else:
        with tempfile.TemporaryDirectory(prefix="bench-node-loss-") as out:
            yield out


def _stepping(job: Job, since: float) -> dict[int, float]:
    """rank -> first step time after `since` of workers started after it, once all 6 ranks stepped (else {})."""
    first: dict[int, float] = {}
    started = min((float(v[0]) for v in _started(job, since)), default=None)
    for at, _, _, world, rank, _ in sorted(job.steps()):
        if started is not None and at > started and world == 6:
            first.setdefault(rank, at)
    return first if len(first) == 6 else {}


def netns_run(i: int, state_mb: str) -> dict:
    """The --lost case with each node a network-namespace host (tests/multihost) and group rank 1's host cut off
    (its link down: no FIN, found only by its lease) rather than killed: the spare takes its place."""
    from pathlib import Path

    from tests.multihost import netns
    from tests.multihost.job import MultiHostJob
    env = {"STATE_MB": state_mb, "STEP_S": "0.2", "SNAP_EVERY": "5", "DISK_EVERY": "50"}
    with netns.Network(["server", "a", "b", "c", "s"]) as net, tempfile.TemporaryDirectory(prefix="bnl-ns-") as out:
        job = MultiHostJob(net, Path(out), f"netns-{i}")
        try:
            job.start_server()
            for host in ("a", "b", "c", "s"):
                job.start_agent(host, nproc=2, script=SCRIPT, env={"NODE": host, **env},
                                extra=("--failure-domain", f"rack-{host}", "--last-call", "1"))
                if host == "c":
                    wait(lambda: len(_ranks(out)) == 6, 120, "every rank stepping")
            job.agents["s"].wait_for_line(r"ready after", 60)
            view = job.view() or {}
            lost = next(n["node_id"] for n in view["nodes"] if n["group_rank"] == 1)
            now = max((s for _, s, *_ in _rows(out)), default=0)
            target = max(KILL_AFTER, now + 1 + (2 - (now + 1)) % 5)
            wait(lambda: max((s for _, s, *_ in _rows(out)), default=0) >= target, 120, f"step {target}")
            cut_at = time.time()
            net.cut(lost)
            back = wait(lambda: len(_resumes(out, cut_at)) == 6 and _resumes(out, cut_at), 120, "every rank again")
            assert isinstance(back, dict)
            started = min(float(v[0]) for v in back.values())

            def stepping() -> dict[int, float]:
                first: dict[int, float] = {}
                for at, _, _, world, rank, _ in sorted(_rows(out)):
                    if at > started and world == 6:
                        first.setdefault(rank, at)
                return first if len(first) == 6 else {}
            first = wait(stepping, 120, "every rank stepping again")
            assert isinstance(first, dict)
            return {"kind": "netns-cut", "run": i, "victims": [lost], "killed_after_step": target,
                    "steps": sorted({int(v[1]) for v in back.values()}),
                    "sources": sorted({v[2] for v in back.values()}),
                    "own_shards": sum(v[3] == "ok" for v in back.values()),
                    "stepping_again_s": round(max(first.values()) - cut_at, 2),
                    "fetched": [ln for ln in job.agents["s"].lines if "snapshots" in ln][:1]}
        finally:
            job.close()


def _rows(out: str) -> list[tuple[float, int, int, int, int, str]]:
    rows = []
    for path in glob.glob(os.path.join(out, "steps-*.txt")):
        with open(path) as f:
            rows += [(float(p[0]), int(p[1]), int(p[2]), int(p[3]), int(p[4]), "") for p in (ln.split() for ln in f)
                     if len(p) == 5]
    return rows


def _ranks(out: str) -> set[int]:
    return {r[4] for r in _rows(out)}


def _resumes(out: str, since: float) -> dict[int, list[str]]:
    """rank -> [time, step, source, ok] of each rank started after `since`."""
    with contextlib.suppress(FileNotFoundError), open(os.path.join(out, "resumed.txt")) as f:
        return {int(p[1]): [p[0], *p[2:5]] for p in (ln.split() for ln in f) if len(p) == 6 and float(p[0]) > since}
    return {}


def cost_run(port: int, i: int, replicas: int, seconds: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-node-loss-") as out:
        job = Job(port, f"cost{replicas}-{i}", out, "3:3", ("--replicas", str(replicas)))
        try:
            for n in ("a", "b", "c"):
                job.start(n)
            wait(lambda: len({r for *_, r, _ in job.steps()}) == 6, 120, "the first world")
            time.sleep(seconds)          # the measured stretch of training
            rows = sorted(r for r in job.steps() if r[4] == 0)
            gaps = [b[0] - a[0] for a, b in zip(rows, rows[1:], strict=False)][3:]
            saves = []
            for path in glob.glob(os.path.join(out, "saves-*.txt")):
                with open(path) as f:
                    saves += [float(x) for x in f.read().split()]
            job.stop()
            return {"replicas": replicas, "run": i, "median_step_s": round(statistics.median(gaps), 4),
                    "steps": len(rows), "median_save_s": round(statistics.median(saves), 4) if saves else None,
                    "max_save_s": round(max(saves), 4) if saves else None}
        finally:
            for a in job.agents.values():
                if a.poll() is None:
                    a.kill()
                    a.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lost", type=int, default=0)
    p.add_argument("--pair", type=int, default=0)
    p.add_argument("--cost", type=int, default=0)
    p.add_argument("--netns", type=int, default=0, help="runs with network-namespace hosts, one cut off (root)")
    p.add_argument("--state-mb", default="32")
    p.add_argument("--cost-s", type=float, default=60.0)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "bench-node-loss.json"))
    args = p.parse_args()
    extra = ("--replicas", str(args.replicas))
    rows: list[dict] = []
    for i in range(args.netns):
        rows.append(netns_run(i, args.state_mb))
        print(json.dumps(rows[-1]), flush=True)
    with running_server() as port:
        for i in range(args.lost):
            for crash in (False, True):
                rows.append(loss_run(port, i, (1,), crash, extra))
                print(json.dumps(rows[-1]), flush=True)
        for i in range(args.pair):
            rows.append(loss_run(port, i, (1, 2), False, extra))
            print(json.dumps(rows[-1]), flush=True)
        for i in range(args.cost):
            for replicas in (args.replicas, 0):
                rows.append(cost_run(port, i, replicas, args.cost_s))
                print(json.dumps(rows[-1]), flush=True)
    for kind in ("lost1", "crash", "lost2", "netns-cut"):
        mine = [r for r in rows if r.get("kind") == kind]
        if mine:
            again = [r["stepping_again_s"] for r in mine if r["stepping_again_s"] is not None]
            print(f"RESULT {kind}: resumed from {[r['steps'] for r in mine]} via {[r['sources'] for r in mine]}, "
                  f"own shards {[r['own_shards'] for r in mine]}/6, stepping again median "
                  f"{statistics.median(again) if again else None} s {again}", flush=True)
    for k in (args.replicas, 0):
        mine = [r["median_step_s"] for r in rows if r.get("replicas") == k]
        if mine:
            saves = [r["median_save_s"] for r in rows if r.get("replicas") == k and r["median_save_s"] is not None]
            print(f"RESULT cost replicas={k}: median step {statistics.median(mine):.4f} s {mine}; save call "
                  f"{statistics.median(saves) if saves else None} s {saves}", flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
