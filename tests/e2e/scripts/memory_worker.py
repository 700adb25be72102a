"""Test worker without torch: uses the agent's in-memory checkpoint directory through node_agent.snapshot.

OUT_DIR: where rank<RANK>-attempt<N>.json goes ({"dir": $NODE_AGENT_MEMORY_DIR, "limit": ..., "exists": the
directory is there, "found": the newest step it held on start, "full": a MemoryDirFull message}).
Every rank saves step 10 * (attempt + 1). CRASH_RANK=R: rank R exits 1 on the first attempt after saving,
once every rank wrote its record.
SAVE_BYTES=N: the snapshot's size (default 100). WAIT_FILE=F: wait until F exists before exiting 0.
"""
import json
import os
import sys
import time

from node_agent.training import snapshot

rank = int(os.environ["RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
where = os.environ.get(snapshot.DIR_VAR)
record = {"dir": where, "limit": os.environ.get(snapshot.LIMIT_VAR), "exists": bool(where) and os.path.isdir(where),
          "found": snapshot.newest() if where else None, "full": None, "saved": None}
if where:
    step = 10 * (attempt + 1)
    try:
        snapshot.save(b"x" * int(os.environ.get("SAVE_BYTES", "100")), step)
        record["saved"] = step
    except snapshot.MemoryDirFull as exc:   # no room: the worker says so and goes on
        record["full"] = str(exc)
out = os.environ["OUT_DIR"]
tmp = os.path.join(out, f".rank{rank}-attempt{attempt}.tmp")
with open(tmp, "w") as f:
    json.dump(record, f)
os.replace(tmp, os.path.join(out, f"rank{rank}-attempt{attempt}.json"))
if attempt == 0 and str(rank) == os.environ.get("CRASH_RANK"):
    # crash only once every rank has written its record: a rank still starting would be stopped first
    others = [os.path.join(out, f"rank{r}-attempt0.json") for r in range(int(os.environ["WORLD_SIZE"]))]
    deadline = time.monotonic() + 60
    while not all(map(os.path.exists, others)) and time.monotonic() < deadline:
        time.sleep(0.01)
    sys.exit(1)
wait = os.environ.get("WAIT_FILE")
while wait and not os.path.exists(wait):
    time.sleep(0.05)
