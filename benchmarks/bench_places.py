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
  --old DIR       alternate every run with the server and agents of the checkout DIR (this script's worker)

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


CODE = {"new": ROOT}           # --code: the checkout whose server and agents run ("old": alternated with this one)


class Job:
    def __init__(self, port: int, job: str, out: str, nnodes: str, code: str = "new") -> None:
        self.port, self.job, self.out, self.nnodes, self.code = port, job, out, nnodes, code
        self.agents: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, node: str) -> None:
        env = dict(os.environ, PYTHONPATH=CODE[self.code], OUT_DIR=self.out, NODE=node)
        with open(os.path.join(self.out, f"agent-{node}.log"), "w") as log:
            self.agents[node] = subprocess.Popen(
                [sys.executable, "-m", "node_agent.main", "--endpoint", f"127.0.0.1:{self.port}", "--nnodes",
                 self.nnodes, "--nproc", "2", "--job-id", self.job, "--node-id", node, "--max-restarts", "5", *FAST,
                 SCRIPT], env=env, cwd=self.out, stdout=log, stderr=subprocess.STDOUT)

    def steps(self) -> list[tuple[float, int, int, int, int, int, int, str]]:
        """(time, step, restart, world, group rank, rank, master port, node) of every step logged."""
        rows = []
        for name in os.listdir(self.out):
            if name.startswith("steps-"):
                node = name.split("-")[1]
                with open(os.path.join(self.out, name)) as f:
                    rows += [(float(p[0]), *(int(x) for x in p[1:7]), node) for p in (ln.split() for ln in f)
                             if len(p) == 7]
        return rows

    def rounds(self) -> dict[tuple[int, int], list[tuple[float, int, int, int, int, int, int, str]]]:
        """The steps by round: (restart, master port), new for each round."""
        out: dict[tuple[int, int], list[tuple[float, int, int, int, int, int, int, str]]] = {}
        for row in sorted(self.steps()):
            out.setdefault((row[2], row[6]), []).append(row)
        return out

    def new_world(self, known: set[tuple[int, int]], world: int) -> dict[int, tuple[str, int, float]] | None:
        """rank -> (node, group rank, first step time) of a round not in `known` once all `world` ranks stepped."""
        for key, rows in self.rounds().items():
            if key in known:
                continue
            first: dict[int, tuple[str, int, float]] = {}
            for at, _, _, w, grank, rank, _, node in rows:
                if w == world and rank not in first:
                    first[rank] = (node, grank, at)
            if len(first) == world:
                return first
        return None

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


def lost_run(port: int, i: int, nodes: list[str], places: list[int], crash: bool, code: str = "new") -> dict:
    """Nodes `nodes`, a spare after them; then the agents of group ranks `places` SIGKILLed (or, `crash`, a
    worker of the first): who holds which ranks in the next world, and kill -> every rank of it stepping."""
    size = len(nodes) * 2
    with tempfile.TemporaryDirectory(prefix="bench-places-") as out:
        job = Job(port, f"{code}-{'crash' if crash else 'lost'}{len(places)}-{i}", out, f"2:{len(nodes)}", code)
        try:
            for n in nodes:
                job.start(n)
            first = wait(lambda: job.new_world(set(), size), 120, "the first world")
            job.start("spare")
            wait(lambda: "spare" in open(os.path.join(out, "agent-spare.log")).read(), 60, "the spare")
            time.sleep(5.0)          # every rank steps a while at full size; the spare's interpreter is ready
            assert isinstance(first, dict)
            before = ranks_of(first)
            kill = [n for n, (grank, _) in before.items() if grank in places]
            known = set(job.rounds())
            killed_at = time.time()
            if crash:
                os.kill(worker_pid(out, kill[0]), signal.SIGKILL)
            else:
                for n in kill:
                    job.agents[n].send_signal(signal.SIGKILL)
            expect = size - 2 * (len(kill) - 1)       # one spare takes one place
            after = wait(lambda: job.new_world(known, expect), 120, "the next world")
            assert isinstance(after, dict)
            again = max(t for _, _, t in after.values()) - killed_at
            placed = ranks_of(after)
        finally:
            job.stop()
            for a in job.agents.values():
                if a.poll() is None:
                    a.kill()
    row = {"kind": "crash" if crash else f"{len(places)} lost", "code": code, "run": i, "before": before,
           "after": placed,
           "stepping_again_s": round(again, 3)}
    print(json.dumps(row), flush=True)
    return row


def scale_up_run(port: int, i: int, code: str = "new") -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-places-") as out:
        job = Job(port, f"{code}-grow-{i}", out, "1:2", code)
        try:
            job.start("a")
            wait(lambda: job.new_world(set(), 2), 120, "a alone")
            time.sleep(1.0)
            known = set(job.rounds())
            launched = time.time()
            job.start("b")
            grown = wait(lambda: job.new_world(known, 4), 120, "the grown world")
            assert isinstance(grown, dict)
            rounds = job.rounds()
            last_small = max(r[0] for key in known for r in rounds[key] if r[7] == "a")
            first_big = min(t for node, _, t in grown.values() if node == "a")
        finally:
            job.stop()
    row = {"kind": "scale-up", "code": code, "run": i,
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
    p.add_argument("--old", help="a checkout to alternate with this one (its server and agents; this script)")
    args = p.parse_args()
    codes = ["new"]
    if args.old:
        CODE["old"] = os.path.abspath(args.old)
        codes.append("old")
    rows: list[dict] = []
    for i in range(max(args.lost, args.lost2, args.scale_up)):
        for code in codes:            # alternated: the machine's load weighs on both alike
            with running_server(root=CODE[code]) as port:
                if i < args.lost:
                    rows.append(lost_run(port, i, ["n0", "n1", "n2"], [1], crash=False, code=code))
                    rows.append(lost_run(port, i, ["n0", "n1", "n2"], [1], crash=True, code=code))
                if i < args.lost2:
                    rows.append(lost_run(port, i, ["n0", "n1", "n2", "n3"], [1, 2], crash=False, code=code))
                if i < args.scale_up:
                    rows.append(scale_up_run(port, i, code))
    for code in codes:
        for kind in ("1 lost", "crash", "2 lost"):
            mine = [r for r in rows if r["kind"] == kind and r["code"] == code]
            if mine:
                again = [r["stepping_again_s"] for r in mine]
                kept = sum(all(r["after"].get(n) == v for n, v in r["before"].items() if n in r["after"])
                           for r in mine)
                print(f"RESULT {code} {kind}: every rank stepping again after median {statistics.median(again):.2f} s "
                      f"(max {max(again):.2f}) over {len(mine)} runs; survivors kept their ranks in {kept}; "
                      f"ranks after, last run: {mine[-1]['after']}", flush=True)
        grow = [r for r in rows if r["kind"] == "scale-up" and r["code"] == code]
        if grow:
            stood = [r["a_stood_stopped_s"] for r in grow]
            print(f"RESULT {code} scale-up 1 -> 2: the running node stood stopped median {statistics.median(stood):.2f}"
                  f" s (max {max(stood):.2f}) over {len(grow)} runs", flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
