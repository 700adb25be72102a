"""Test worker without torch: ranks whose snapshot writes end at different times (node_agent/training/snapshot.py).

Attempt 0: every rank saves steps 1 and 2. Rank 1 then begins its write of step 3 and never ends it (a write longer
than the snapshots' interval); rank 0 saves step 3, waits until the agent names the held floor (KEEP_FROM, at
most 60 s), saves step 4, writes its record and exits 1. Attempt 1: each rank writes the steps it holds to
OUT_DIR/held<RANK>.json and exits 0.
"""
import json
import os
import sys
import time

from node_agent.training import snapshot

rank = int(os.environ["RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
out = os.environ["OUT_DIR"]
where = snapshot.directory()
assert where is not None, "no memory directory"


def record(name: str, value: object) -> None:
    tmp = os.path.join(out, f".{name}.tmp")
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, os.path.join(out, name))


def never_ends(f) -> None:
    record("writing.json", rank)
    while True:
        time.sleep(0.05)       # until the agent stops this worker


if attempt > 0:
    record(f"held{rank}.json", snapshot.steps())
    sys.exit(0)
snapshot.save(b"x" * 100, 1)
snapshot.save(b"x" * 100, 2)
if rank == 1:
    snapshot.save(never_ends, 3)
snapshot.save(b"x" * 100, 3)
deadline = time.monotonic() + 60
while snapshot.floors(where)[1] is None and time.monotonic() < deadline:
    time.sleep(0.05)
while not os.path.exists(os.path.join(out, "writing.json")) and time.monotonic() < deadline:
    time.sleep(0.05)
snapshot.save(b"x" * 100, 4)
record("kept_from.json", snapshot.floors(where)[1])
sys.exit(1)
