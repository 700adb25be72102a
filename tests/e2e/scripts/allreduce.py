"""Test worker: gloo all-reduce, then record what it saw in OUT_DIR/rank<R>-attempt<N>.json.

FAIL_RANK=R FAIL_MODE=once|always makes rank R exit 1 (once: only at restart count 0).
"""
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

VARS = ["RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
        "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCHELASTIC_ERROR_FILE", "OMP_NUM_THREADS",
        "TORCHELASTIC_SIGNALS_TO_HANDLE", "RDZV_TOKEN", "RDZV_TOKEN_FILE"]


@record
def main() -> None:
    env = {k: os.environ.get(k) for k in VARS}
    rank, attempt = int(env["RANK"]), int(env["TORCHELASTIC_RESTART_COUNT"])
    fail_rank = int(os.environ.get("FAIL_RANK", "-1"))
    mode = os.environ.get("FAIL_MODE", "")
    if rank == fail_rank and (mode == "always" or (mode == "once" and attempt == 0)):
        raise RuntimeError(f"planned failure of rank {rank} at attempt {attempt}")
    dist.init_process_group("gloo")
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    record_ = {"env": env, "sum": t.item(), "world": dist.get_world_size(), "pid": os.getpid(),
               "cpus": sorted(os.sched_getaffinity(0))}
    path = os.path.join(os.environ["OUT_DIR"], f"rank{rank}-attempt{attempt}.json")
    with open(path, "w") as f:
        json.dump(record_, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
