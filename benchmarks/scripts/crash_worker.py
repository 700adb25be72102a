"""Benchmark worker (no torch import, so launcher time is what gets measured).

Appends "start <rank> <attempt> <unix time>" to $BENCH_LOG. Before any crash, rank $CRASH_RANK
waits until every rank has started, appends "crash <time>" and exits 1; the others wait to be
stopped. A worker started after the crash exits 0 at once. "After the crash" is read from the log,
not from TORCHELASTIC_RESTART_COUNT, because torchrun counts restarts per agent (the agent whose
workers did not fail restarts them with count 0).
"""
import os
import sys
import time

log = os.environ["BENCH_LOG"]
rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])


def append(line: str) -> None:
    with open(log, "a") as f:
        f.write(line + "\n")


def crashed() -> bool:
    with open(log) as f:
        return any(ln.startswith("crash") for ln in f)


after_crash = os.path.exists(log) and crashed()
append(f"start {rank} {int(after_crash)} {time.time():.6f}")
if after_crash:
    sys.exit(0)
if rank == int(os.environ.get("CRASH_RANK", "-1")):
    deadline = time.time() + 30
    while time.time() < deadline:  # wait until all ranks of attempt 0 are up (benchmark setup only)
        with open(log) as f:
            if sum(1 for ln in f if ln.startswith("start") and ln.split()[2] == "0") >= world:
                break
        time.sleep(0.01)
    time.sleep(0.2)
    append(f"crash {rank} {time.time():.6f}")
    sys.exit(1)
time.sleep(60)
