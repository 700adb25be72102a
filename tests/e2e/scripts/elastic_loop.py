"""Test worker for the elastic tests: a gloo all-reduce loop that logs every step.

Writes JSON lines to OUT_DIR/steps-<pid>.jsonl (one file per worker process, so lines never
interleave):
- one "start" line once the process group is up, with the (world size, master port, restart
  count, group world size) every rank of the group saw (all-gathered, so a disagreement shows);
- one "step" line per all-reduce, with the reduced sum (== world size when every rank took part).

The loop ends together on every rank (the stop flag travels inside the all-reduce): after STEPS
steps, or once OUT_DIR/stop exists; then exit 0.

FAIL_FILE=path: exit 3 at once (before importing torch) while that file exists.
FAIL_RANK=R FAIL_STEP=S: rank R exits 1 after step S, only at restart count 0.
STEP_SLEEP: seconds between steps (default 0.2).
"""
import json
import os
import sys
import time

OUT = os.environ["OUT_DIR"]
fail_file = os.environ.get("FAIL_FILE")
if fail_file and os.path.exists(fail_file):
    print(f"failing on purpose: {fail_file} exists", file=sys.stderr, flush=True)
    sys.exit(3)

from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
master_port = int(os.environ["MASTER_PORT"])
group_world = int(os.environ["GROUP_WORLD_SIZE"])
base = {
    "rank": rank, "local_rank": int(os.environ["LOCAL_RANK"]), "group_rank": int(os.environ["GROUP_RANK"]),
    "world": world, "group_world": group_world, "local_world": int(os.environ["LOCAL_WORLD_SIZE"]),
    "restart": restart, "master_addr": os.environ["MASTER_ADDR"], "master_port": master_port,
    "pid": os.getpid(), "ppid": os.getppid(), "node": os.environ.get("NODE", ""),
}
log = open(os.path.join(OUT, f"steps-{os.getpid()}.jsonl"), "a", buffering=1)


def emit(**fields) -> None:
    log.write(json.dumps({**base, **fields, "t": time.time()}) + "\n")
    log.flush()


dist.init_process_group("gloo", timeout=timedelta(seconds=60))
view = torch.tensor([world, master_port, restart, group_world], dtype=torch.int64)
views = [torch.zeros_like(view) for _ in range(dist.get_world_size())]
dist.all_gather(views, view)
emit(kind="start", views=[v.tolist() for v in views], pg_world=dist.get_world_size())

steps = int(os.environ.get("STEPS", "1000000"))
pause = float(os.environ.get("STEP_SLEEP", "0.2"))
stop_file = os.path.join(OUT, "stop")
fail_rank = int(os.environ.get("FAIL_RANK", "-1"))
fail_step = int(os.environ.get("FAIL_STEP", "-1"))
for step in range(steps):
    t = torch.tensor([1.0, 1.0 if os.path.exists(stop_file) else 0.0])
    dist.all_reduce(t)
    emit(kind="step", step=step, sum=t[0].item())
    if rank == fail_rank and step == fail_step and restart == 0:
        print(f"rank {rank} failing on purpose after step {step}", file=sys.stderr, flush=True)
        os._exit(1)
    if t[1].item() > 0:
        break
    time.sleep(pause)
dist.barrier()
dist.destroy_process_group()
emit(kind="done")
