"""make gpu-check's worker: NCCL DDP on this rank's GPU. Prints JSON lines: its first step (with the CUDA
context's creation time and its CPUs), and a crash once (the last rank, at step CRASH_STEP, while
GPU_CHECK_MARKER does not exist yet). Started by node-agent, so LOCAL_RANK and the rest are torchrun's."""
from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist


def say(event: str, **fields: object) -> None:
    print("GPU-CHECK " + json.dumps({"event": event, "t": time.time(), **fields}), flush=True)


def main() -> None:
    local = int(os.environ["LOCAL_RANK"])
    began = time.perf_counter()
    torch.cuda.set_device(local)
    torch.zeros(1, device="cuda")               # the CUDA context comes up here
    ctx_s = time.perf_counter() - began
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2048, 2048).cuda(), device_ids=[local])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    marker, crash_step = os.environ["GPU_CHECK_MARKER"], int(os.environ.get("CRASH_STEP", "5"))
    for step in range(int(os.environ.get("STEPS", "20"))):
        model(torch.randn(64, 2048, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        if step == 0:
            say("first_step", rank=rank, ctx_s=ctx_s, restart=int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
                cpus=sorted(os.sched_getaffinity(0)))
        if step == crash_step and rank == world - 1 and not os.path.exists(marker):
            open(marker, "w").close()
            say("crash", rank=rank)
            os._exit(1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
