"""FSDP2 (fully_shard) on gloo, with `protect(model, opt, every=3)`: each rank snapshots its own shards.
CRASH_RANK=R: rank R raises once (first attempt) when CRASH_STEP optimizer steps are done. FINAL=FILE: rank 0
writes the full weights (gathered) at the end. Prints `rank R: training from step S`."""
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from node_agent.training import protect

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
start = protect(model, opt, every=3, extra={"sched": sched})
print(f"rank {rank}: training from step {start}", flush=True)
crash_step = int(os.environ.get("CRASH_STEP", "-1"))
for step in range(start, 12):
    if rank == int(os.environ.get("CRASH_RANK", "-1")) and step == crash_step \
            and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        raise RuntimeError(f"injected crash on rank {rank} at step {step}")
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 10 + rank))
    model(x).pow(2).mean().backward()
    opt.step()
    sched.step()
    opt.zero_grad()
full = {k: v.full_tensor() for k, v in model.state_dict().items()}
if rank == 0 and os.environ.get("FINAL"):
    torch.save(full, os.environ["FINAL"])
dist.destroy_process_group()
