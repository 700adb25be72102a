"""HSDP (fully_shard on a replicate x shard mesh, gloo) with `protect(every=5)`, for benchmarks/bench_suspects.py:
REPLICAS x (WORLD_SIZE / REPLICAS) ranks, STEPS steps of STEP_S, KEEP snapshots kept (2); FLIP=RANK:STEP flips one
bit of a weight on global rank RANK after STEP's optimizer step (first attempt), as silent data corruption would.
At the end every rank's shard is compared with its shard's other replicas: rank 0 prints "replicas alike at the end:
yes|NO"."""
import os
import time
import zlib

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from node_agent.training import protect

env = os.environ.get
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
replicas = int(env("REPLICAS", "2"))
mesh = init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
restart = int(env("TORCHELASTIC_RESTART_COUNT", "0"))
steps, step_s = int(env("STEPS", "30")), float(env("STEP_S", "0.25"))
flip_rank, flip_step = (int(x) for x in (env("FLIP") or "-1:0").split(":"))

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32))
fully_shard(model, mesh=mesh)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
start = protect(model, opt, every=5, keep=int(env("KEEP", "2")))
print(f"rank {rank}: resumed from step {start} ({'memory' if start else 'scratch'})", flush=True)
for step in range(start, steps):
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step * 1000 + mesh.get_coordinate()[1]))
    loss = torch.nn.functional.mse_loss(model(x), x)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if rank == flip_rank and step == flip_step and restart == 0:
        with torch.no_grad():
            next(model.parameters()).to_local().view(-1)[:1].view(torch.int32).bitwise_xor_(1 << 20)
    time.sleep(step_s)
crc = zlib.crc32(b"".join(p.to_local().detach().numpy().tobytes() for p in model.parameters()))
every = [None] * world
dist.all_gather_object(every, (mesh.get_coordinate()[1], crc))
if rank == 0:
    shards = {}
    for shard, value in every:
        shards.setdefault(shard, set()).add(value)
    print(f"replicas alike at the end: {'yes' if all(len(v) == 1 for v in shards.values()) else 'NO'}", flush=True)
dist.destroy_process_group()
