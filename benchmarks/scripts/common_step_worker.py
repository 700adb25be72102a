"""Worker for bench_common_step.py (torch-free): ranks in lockstep (a file barrier stands in for the collectives)
that snapshot every step, each write in a thread as protect's are, the next snapshot waiting for the previous write.
Rank R's writes take uniform(0, JITTER_R) seconds. Rank 0 samples every 5 ms whether the local ranks' memory
directories hold a complete step in common, and how many each holds, into OUT/samples.json.

Env: OUT, STEPS, INTERVAL (s a step computes), JITTER (rank 1's; rank 0's is a tenth), SIZE (bytes a snapshot).
"""
import json
import os
import random
import threading
import time

from node_agent.training import snapshot

rank, world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
out, steps = os.environ["OUT"], int(os.environ.get("STEPS", "150"))
interval, jitter = float(os.environ.get("INTERVAL", "0.05")), float(os.environ.get("JITTER", "0.3"))
size = int(os.environ.get("SIZE", str(2**20)))
where = snapshot.directory()
assert where is not None
dirs = [os.path.join(os.path.dirname(where), str(r)) for r in range(world)]
slow = jitter if rank == 1 else jitter / 10
done = threading.Event()


def write(step: int) -> None:
    def writer(f) -> None:
        f.write(b"x" * size)
        time.sleep(random.uniform(0.0, slow))
    snapshot.save(writer, step)


def sample() -> None:
    seen = {"samples": 0, "none_in_common": 0, "held": 0, "held_most": 0}
    while not done.is_set():
        held = [set(snapshot.steps(d)) for d in dirs]
        if all(held):
            seen["samples"] += 1
            seen["none_in_common"] += not set.intersection(*held)
            seen["held"] += sum(map(len, held))          # complete snapshots a rank holds, summed over ranks
            seen["held_most"] = max(seen["held_most"], *map(len, held))
        time.sleep(0.005)
    with open(os.path.join(out, ".samples.tmp"), "w") as f:
        json.dump(seen, f)
    os.replace(os.path.join(out, ".samples.tmp"), os.path.join(out, "samples.json"))


sampler = threading.Thread(target=sample) if rank == 0 else None
if sampler is not None:
    sampler.start()
writing: threading.Thread | None = None
for step in range(1, steps + 1):
    open(os.path.join(out, f"b-{step}-{rank}"), "w").close()
    while not all(os.path.exists(os.path.join(out, f"b-{step}-{r}")) for r in range(world)):
        time.sleep(0.001)     # the step's collectives: no rank gets a step ahead
    time.sleep(interval)      # the step's compute
    if writing is not None:
        writing.join()        # the next snapshot waits for the previous write
    writing = threading.Thread(target=write, args=(step,))
    writing.start()
if writing is not None:
    writing.join()
done.set()
if sampler is not None:
    sampler.join()
