"""A small real DDP training on CPU (gloo), launched unchanged by torchrun or node-agent.

It reads only what torchrun provides in the environment. `--crash-rank R --crash-step S` makes
global rank R raise once (on the first attempt, TORCHELASTIC_RESTART_COUNT=0) to show recovery.
"""
from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP


@record
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--crash-rank", type=int, default=-1)
    p.add_argument("--crash-step", type=int, default=5)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    print(f"rank {rank}/{world} (local {os.environ['LOCAL_RANK']}, node group rank {os.environ['GROUP_RANK']}) "
          f"on {socket.gethostname()} pid {os.getpid()}, attempt {restart}, "
          f"master {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", flush=True)

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    data = torch.Generator().manual_seed(1000 + rank)
    for step in range(args.steps):
        x = torch.randn(64, 16, generator=data)
        y = x.sum(dim=1, keepdim=True)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == args.crash_rank and step == args.crash_step and restart == 0:
            raise RuntimeError(f"injected crash on rank {rank} at step {step}")
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {mean.item() / world:.4f}", flush=True)
    dist.destroy_process_group()
    if rank == 0:
        print(f"training done: {args.steps} steps on {world} workers", flush=True)


if __name__ == "__main__":
    main()
