"""How often a node's ranks hold no snapshot step in common while one rank's writes run longer than the others'
(a failure then finds no step every rank holds: a job of shards goes back to disk or step 0).

A real standalone node-agent, 2 torch-free workers in lockstep snapshotting every step (scripts/common_step_worker.py:
rank 1's writes take up to JITTER s, longer than a step), rank 0 sampling both directories every 5 ms. Each
checkout in --roots is run in turn, alternated, --runs times.

Run: .venv/bin/python benchmarks/bench_common_step.py [--roots /tmp/old,.] [--runs 3] (make bench-common-step).
An old checkout: `git worktree add /tmp/old <commit>`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "scripts", "common_step_worker.py")


def run(root: str, env_extra: dict[str, str]) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, PYTHONPATH=root, OUT=out, **env_extra)
        done = subprocess.run([sys.executable, "-m", "node_agent", "--standalone", "--nproc", "2",
                               "--max-restarts", "0", "--memory-dir-limit", "256M", WORKER],
                              env=env, cwd=root, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise SystemExit(f"{root}: node-agent exited {done.returncode}\n{done.stderr[-3000:]}")
        with open(os.path.join(out, "samples.json")) as f:
            return dict(json.load(f))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--roots", default=os.path.dirname(HERE), help="checkouts, comma-separated (alternated)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--interval", type=float, default=0.05, help="seconds a step computes")
    p.add_argument("--jitter", type=float, default=0.3, help="rank 1's writes take up to this many seconds")
    args = p.parse_args()
    roots = [os.path.abspath(r) for r in args.roots.split(",")]
    extra = {"STEPS": str(args.steps), "INTERVAL": str(args.interval), "JITTER": str(args.jitter)}
    seen: dict[str, list[float]] = {r: [] for r in roots}
    for i in range(args.runs):
        for root in roots:
            s = run(root, extra)
            share = s["none_in_common"] / max(1, s["samples"])
            seen[root].append(share)
            print(f"run {i + 1} {root}: no step in common {share:.1%} of {s['samples']} samples; a rank held "
                  f"{s['held'] / max(1, 2 * s['samples']):.2f} snapshots on average, {s['held_most']} at most",
                  flush=True)
    for root, shares in seen.items():
        print(f"{root}: no step in common {min(shares):.1%}-{max(shares):.1%} of the time "
              f"(median {sorted(shares)[len(shares) // 2]:.1%}; steps {args.steps}, a step {args.interval:g}s, "
              f"rank 1's writes up to {args.jitter:g}s)")


if __name__ == "__main__":
    main()
