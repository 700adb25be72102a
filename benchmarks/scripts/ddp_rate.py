"""DDP steps as fast as they go, with `protect(every=5)` for benchmarks/bench_suspects.py's digest cost: on the DDP
model (DIGESTS=1: the replicas' digest told with each snapshot) or on its inner module (DIGESTS=0: the same
snapshots, no digest). STEPS steps of a WIDTH x WIDTH, 4-layer MLP; rank 0 prints "rate S steps/s" over the
steps after the first 10."""
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from node_agent.training import protect

env = os.environ.get
dist.init_process_group("gloo")
width, steps = int(env("WIDTH", "256")), int(env("STEPS", "300"))
torch.manual_seed(0)
inner = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
model = DDP(inner)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
start = protect(model if env("DIGESTS", "1") == "1" else inner, opt, every=5)
began = None
for step in range(start, steps):
    if step == start + 10:
        began = time.perf_counter()
    x = torch.randn(32, width, generator=torch.Generator().manual_seed(step))
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
if dist.get_rank() == 0 and began is not None:
    print(f"rate {(steps - start - 10) / (time.perf_counter() - began):.3f} steps/s", flush=True)
dist.destroy_process_group()
