"""A gloo DDP training for benchmarks/bench_places.py: a step every STEP_S (0.05 s), each logged with the world it
ran in, to OUT_DIR/steps-NODE-LOCAL_RANK.txt ("unix_time step restart world_size group_rank rank master_port" per
line: the port is new each round), so the benchmark sees who held which ranks in each round and when every rank
stepped again (OUT_DIR/pid-NODE-LOCAL_RANK: its pid, for a crash to be injected). It trains until OUT_DIR/stop
exists (decided together every 10 steps, so every rank stops at the same step).
"""
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

env = os.environ.get
out = env("OUT_DIR", ".")
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
restart, group_rank = int(env("TORCHELASTIC_RESTART_COUNT", "0")), int(env("GROUP_RANK", "0"))
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
step_s = float(env("STEP_S", "0.05"))
me = f"{env('NODE', '?')}-{env('LOCAL_RANK', '0')}"
with open(os.path.join(out, f"pid-{me}"), "w") as f:
    f.write(str(os.getpid()))
log = open(os.path.join(out, f"steps-{me}.txt"), "a")  # noqa: SIM115 - the run's own log, open for its life
step = 0
while True:
    if step % 10 == 0:
        stop = torch.tensor([float(os.path.exists(os.path.join(out, "stop")))])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item():
            break
    loss = model(torch.randn(8, 32)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    log.write(f"{time.time():.6f} {step} {restart} {world} {group_rank} {rank} {env('MASTER_PORT')}\n")
    log.flush()
    time.sleep(step_s)
log.close()
dist.destroy_process_group()
