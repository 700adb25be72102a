"""Test worker for the torchrun plugin tests: a gloo all-reduce loop that logs what it saw.

Writes JSON lines to OUT_DIR/steps-<pid>.jsonl (one file per process, so lines never interleave):
one "start" line once the process group is up, one "step" line per all-reduce (its sum is the
world size when every rank took part), and "done" at the end. Each line carries the worker's
environment as torchrun set it, plus RDZV_SERVER_RESTART_COUNT (the job-wide count).

The loop ends on every rank together (the stop flag travels inside the all-reduce): after STEPS
steps, or once OUT_DIR/stop exists; then exit 0.

FAIL_RANK=R FAIL_STEP=S FAIL_ONCE=path: rank R exits 1 after step S, the first time only (the file
`path` records that it did); FAIL_STEP=end: after the loop, once every rank left the process group
and (with JOB_URL, the server's /v1/jobs/ID) once another node reported success to the server.
FAIL_RANK=R FAIL_ALWAYS=1: rank R exits 1 before its first step, always.
"""
import json
import os
import sys
import time
import urllib.request
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

OUT = os.environ["OUT_DIR"]
ENV = ["RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR",
       "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
       "TORCHELASTIC_USE_AGENT_STORE", "RDZV_SERVER_RESTART_COUNT"]


def other_node_succeeded(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=10) as resp:
        nodes = json.load(resp)["nodes"]
    return any(n["node_id"] != os.environ.get("NODE") and n.get("worker_state") == "succeeded" for n in nodes)


@record
def main() -> None:
    env = {k: os.environ.get(k) for k in ENV}
    rank = int(env["RANK"])
    base = {"rank": rank, "world": int(env["WORLD_SIZE"]), "node": os.environ.get("NODE", ""),
            "pid": os.getpid(), "env": env}
    log = open(os.path.join(OUT, f"steps-{os.getpid()}.jsonl"), "a", buffering=1)

    def emit(**fields) -> None:
        log.write(json.dumps({**base, **fields, "t": time.time()}) + "\n")

    fail = int(os.environ.get("FAIL_RANK", "-1")) == rank
    if fail and os.environ.get("FAIL_ALWAYS"):
        raise RuntimeError(f"rank {rank} fails on purpose, every time")
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    emit(kind="start", pg_world=dist.get_world_size())
    stop_file = os.path.join(OUT, "stop")
    once = os.environ.get("FAIL_ONCE", "")
    fail_step = os.environ.get("FAIL_STEP", "")
    for step in range(int(os.environ.get("STEPS", "1000000"))):
        t = torch.tensor([1.0, 1.0 if os.path.exists(stop_file) else 0.0])
        dist.all_reduce(t)
        emit(kind="step", step=step, sum=t[0].item())
        if fail and fail_step == str(step) and once and not os.path.exists(once):
            open(once, "w").close()
            raise RuntimeError(f"rank {rank} fails on purpose after step {step}")
        if t[1].item() > 0:
            break
        time.sleep(float(os.environ.get("STEP_SLEEP", "0.2")))
    dist.barrier()
    dist.destroy_process_group()
    if fail and fail_step == "end" and once and not os.path.exists(once):
        open(once, "w").close()
        while os.environ.get("JOB_URL") and not other_node_succeeded(os.environ["JOB_URL"]):
            time.sleep(0.1)   # nothing to block on in another process: poll its state on the server
        raise RuntimeError(f"rank {rank} fails on purpose at the end")
    emit(kind="done")
    print(f"rank {rank} done", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
