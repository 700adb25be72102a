"""What a crash with DataLoader workers alive leaves in TMPDIR: multiprocessing's pymp-* directories.

One node, 2 gloo DDP workers each reading through a DataLoader with 2 worker processes; global rank 1
raises at step 3 of the first attempt while rank 0 (HOLD=1) waits at that step, as a rank blocked in a
collective does, until the agent stops it. The job restarts and finishes. Each run has a fresh TMPDIR;
afterwards the pymp-* directories in it are counted. Target (issue 37): 0 in 10 warm runs.

Run: .venv/bin/python benchmarks/bench_leftovers.py [--runs 10] [--warm auto,off] [--code DIR ...]
--code names other checkouts' roots (a `git worktree` of an older commit) to run alternated with this one.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "e2e", "scripts", "dataloader_crash.py")


def one_run(code: str, warm: str) -> tuple[int, int, float]:
    """(exit status, pymp-* directories left, seconds from start to exit). Run in the temp dir: with
    `python -m`, the working directory comes first on sys.path and would pick its checkout's code."""
    with tempfile.TemporaryDirectory(prefix="bench-leftovers-") as tmp:
        env = dict(os.environ, PYTHONPATH=code, TMPDIR=tmp, HOLD="1", CRASH_RANK="1", CRASH_STEP="3", STEPS="6")
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "node_agent", "--nproc", "2", "--max-restarts", "1",
                               "--warm-workers", warm, SCRIPT], env=env, capture_output=True, text=True,
                              timeout=300, check=False, cwd=tmp)
        took = time.monotonic() - start
        left = sum(1 for name in os.listdir(tmp) if name.startswith("pymp-"))
    if done.returncode:
        print("\n".join(done.stderr.splitlines()[-15:]), flush=True)
    return done.returncode, left, took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--warm", default="auto,off", help="warm-worker modes to run: auto, off or both")
    p.add_argument("--code", action="append", default=[], help="another checkout's root, alternated with this one")
    args = p.parse_args()
    codes = [ROOT, *args.code]
    results: dict[tuple[str, str], list[tuple[int, int, float]]] = {}
    for i in range(args.runs):
        for code in codes:
            for warm in args.warm.split(","):
                rc, left, took = one_run(code, warm)
                results.setdefault((code, warm), []).append((rc, left, took))
                print(f"run {i + 1}: {code} warm={warm}: exit {rc}, {left} pymp-* left, {took:.1f} s", flush=True)
    print("\ncode / warm: runs that left a directory, directories left, exits != 0")
    for (code, warm), runs in results.items():
        print(f"{code} / {warm}: {sum(1 for r in runs if r[1])} of {len(runs)} runs, "
              f"{sum(r[1] for r in runs)} directories, {sum(1 for r in runs if r[0])} failed exits")


if __name__ == "__main__":
    main()
