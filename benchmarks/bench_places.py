"""Issue 45's targets: a spare takes a lost node's place and ranks; a node enters a round only when it can start
at once. Real rdzv-server and node-agents with their defaults (but a 3 s lease and a 1 s last call) on loopback,
2 gloo workers per node running benchmarks/scripts/places_train.py (a step every 50 ms, each logged with its world).

  --lost 3        3 x 2 + 1 spare: the agent of group rank 1 SIGKILLed (its workers die with it), alternated with a
                  worker SIGKILLed on the same job (a crash): who holds which ranks next, and kill -> every rank
                  stepping again, each
  --lost2 3       4 x 2 + 1 spare: the agents of group ranks 1 and 2 SIGKILLed together: the spare's group rank,
                  the round's size and the survivors' order
  --scale-up 3    1 node running, a second launched: how long the first node's workers stand stopped (its last step
                  at world size 2 -> its first at world size 4)

Run: .venv/bin/python benchmarks/bench_places.py [--lost N] [--lost2 N] [--scale-up N] [--out FILE]
     (make bench-places)
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks._server import running_server  # noqa: E402

SCRIPT = os.path.join(ROOT, "benchmarks", "scripts", "places_train.py")
FAST = ("--lease-timeout", "3", "--last-call", "1", "--stop-timeout", "2")


class Job:
    def __init__(self, port: int, job: str, out: str, nnodes: str) -> None:
        self.port, self.job, self.out, self.nnodes = port, job, out, nnodes
        self.agents: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, node: str) -> None:
        env = dict(os.environ, PYTHONPATH=ROOT, OUT_DIR=self.out, NODE=node)
        with open(os.path.join(self.out, f"agent-{node}.log"), "w") as log:
            self.agents[node] = subprocess.Popen(
                [sys.executable, "-m", "node_agent.main", "--endpoint", f"127.0.0.1:{self.port}", "--nnodes",
                 self.nnodes, "--nproc", "2", "--job-id", self.job, "--node-id", node, "--max-restarts", "5", *FAST,
                 SCRIPT], env=env, cwd=self.out, stdout=log, stderr=subprocess.STDOUT)

    def steps(self) -> list[tuple[float, int, int, int, int, int, str]]:
        """(time, step, restart, world, group rank, rank, node) of every step logged."""
        rows = []
        for name in os.listdir(self.out):
            if name.startswith("steps-"):
                node = name.split("-")[1]
                with open(os.path.join(self.out, name)) as f:
                    rows += [(float(p[0]), *(int(x) for x in p[1:6]), node) for p in (ln.split() for ln in f)
                             if len(p) == 6]
        return rows

    def world_after(self, t: float, world: int) -> dict[int, tuple[str, int, float]]:
        """rank -> (node, group rank, first step time) of the world of `world` ranks first stepping after `t`."""
        first: dict[int, tuple[str, int, float]] = {}
        for at, _, _, w, grank, rank, node in sorted(self.steps()):
            if at > t and w == world and rank not in first:
                first[rank] = (node, grank, at)
        return first

    def stop(self) -> None:
        open(os.path.join(self.out, "stop"), "w").close()
        for a in self.agents.values():
            try:
                a.wait(60)
            except subprocess.TimeoutExpired:
                a.kill()
                a.wait()


def wait(check: Callable[[], object], timeout: float, what: str) -> object:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = check()
        if got:
            return got
        time.sleep(0.05)        # polling other processes' files: nothing to wait on
    raise RuntimeError(f"timed out: {what}")


def ranks_of(world: dict[int, tuple[str, int, float]]) -> dict[str, tuple[int, list[int]]]:
    """node -> (group rank, its global ranks)."""
    out: dict[str, tuple[int, list[int]]] = {}
    for rank, (node, grank, _) in sorted(world.items()):
        out.setdefault(node, (grank, []))[1].append(rank)
    return out


def worker_pid(out: str, node: str) -> int:
    with open(os.path.join(out, f"pid-{node}-0")) as f:
        return int(f.read())


def lost_run(port: int, i: int, nodes: list[str], places: list[int], crash: bool) -> dict:
    """Nodes `nodes`, a spare after them; then the agents of group ranks `places` SIGKILLed (or, `crash`, a
    worker of the first): who holds which ranks in the next world, and kill -> every rank of it stepping."""
    size = len(nodes) * 2
    with tempfile.TemporaryDirectory(prefix="bench-places-") as out:
        job = Job(port, f"{'crash' if crash else 'lost'}{len(places)}-{i}", out, f"2:{len(nodes)}")
        try:
            for n in nodes:
                job.start(n)
            wait(lambda: len(job.world_after(0, size)) == size, 120, "the first world")
            job.start("spare")
            wait(lambda: os.path.exists(os.path.join(out, "agent-spare.log"))
                 and "spare" in open(os.path.join(out, "agent-spare.log")).read(), 60, "the spare")
            time.sleep(1.0)          # let every rank step a while at full size
            before = ranks_of(job.world_after(0, size))
            kill = [n for n, (grank, _) in before.items() if grank in places]
            killed_at = time.time()
            if crash:
                os.kill(worker_pid(out, kill[0]), signal.SIGKILL)
            else:
                for n in kill:
                    job.agents[n].send_signal(signal.SIGKILL)
            expect = size - 2 * (len(kill) - 1)       # one spare takes one place
            after = wait(lambda: (w := job.world_after(killed_at, expect)) and len(w) == expect and w, 120,
                         "the next world")
            assert isinstance(after, dict)
            again = max(t for _, _, t in after.values()) - killed_at
            placed = ranks_of(after)
        finally:
            job.stop()
            for a in job.agents.values():
                if a.poll() is None:
                    a.kill()
    row = {"kind": "crash" if crash else f"{len(places)} lost", "run": i, "before": before, "after": placed,
           "stepping_again_s": round(again, 3)}
    print(json.dumps(row), flush=True)
    return row


def scale_up_run(port: int, i: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-places-") as out:
        job = Job(port, f"grow-{i}", out, "1:2")
        try:
            job.start("a")
            wait(lambda: len(job.world_after(0, 2)) == 2, 120, "a alone")
            time.sleep(1.0)
            launched = time.time()
            job.start("b")
            grown = wait(lambda: (w := job.world_after(launched, 4)) and len(w) == 4 and w, 120, "the grown world")
            assert isinstance(grown, dict)
            steps = job.steps()
            last_small = max(t for t, _, _, w, _, _, node in steps if node == "a" and w == 2)
            first_big = min(t for t, _, _, w, _, _, node in steps if node == "a" and w == 4)
        finally:
            job.stop()
    row = {"kind": "scale-up", "run": i,
           "launched_to_grown_s": round(max(t for _, _, t in grown.values()) - launched, 3),
           "a_stood_stopped_s": round(first_big - last_small, 3)}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lost", type=int, default=0, help="runs of one lost node, alternated with a worker crash")
    p.add_argument("--lost2", type=int, default=0, help="runs of two nodes lost at once with one spare")
    p.add_argument("--scale-up", type=int, default=0, help="runs of 1 -> 2 nodes")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "bench-places.json"))
    args = p.parse_args()
    rows: list[dict] = []
    with running_server() as port:
        for i in range(args.lost):
            rows.append(lost_run(port, i, ["n0", "n1", "n2"], [1], crash=False))
            rows.append(lost_run(port, i, ["n0", "n1", "n2"], [1], crash=True))
        for i in range(args.lost2):
            rows.append(lost_run(port, i, ["n0", "n1", "n2", "n3"], [1, 2], crash=False))
        for i in range(args.scale_up):
            rows.append(scale_up_run(port, i))
    for kind in ("1 lost", "crash", "2 lost"):
        mine = [r for r in rows if r["kind"] == kind]
        if mine:
            again = [r["stepping_again_s"] for r in mine]
            print(f"RESULT {kind}: every rank stepping again after median {statistics.median(again):.2f} s "
                  f"(max {max(again):.2f}) over {len(mine)} runs; ranks after: {mine[-1]['after']}", flush=True)
    grow = [r for r in rows if r["kind"] == "scale-up"]
    if grow:
        stood = [r["a_stood_stopped_s"] for r in grow]
        print(f"RESULT scale-up 1 -> 2: the running node stood stopped median {statistics.median(stood):.2f} s "
              f"(max {max(stood):.2f}) over {len(grow)} runs", flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
