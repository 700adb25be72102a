"""A gloo DDP training that prints a numbered line every step, 100 steps a second (benchmarks/bench_console.py).
Each line reads `rank R restart C line I` plus padding to LINE_BYTES; at the end the rank writes how many lines
it printed to OUT_DIR/printed-R-C.txt, so a benchmark can check its log file holds every one. Settings
(environment): DURATION_S (how long to train), LINES_PER_S (100), LINE_BYTES (200), OUT_DIR (".").
"""
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

env = os.environ.get
dist.init_process_group("gloo")
rank = dist.get_rank()
restart = int(env("TORCHELASTIC_RESTART_COUNT", "0"))
duration, rate = float(env("DURATION_S", "60")), float(env("LINES_PER_S", "100"))
width = int(env("LINE_BYTES", "200"))
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
started = time.monotonic()
step = 0


def go_on() -> bool:
    """Decided together every 20 steps: the ranks stop at the same step."""
    if step % 20:
        return True
    over = torch.tensor([float(time.monotonic() - started >= duration)])
    dist.all_reduce(over, op=dist.ReduceOp.MAX)
    return not over.item()


while go_on():
    loss = model(torch.randn(8, 32)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    head = f"rank {rank} restart {restart} line {step} loss {loss.item():.6f} "
    print(head + "." * max(0, width - 1 - len(head)), flush=True)
    step += 1
    time.sleep(max(0.0, started + step / rate - time.monotonic()))    # paced: `rate` lines a second
with open(os.path.join(env("OUT_DIR", "."), f"printed-{rank}-{restart}.txt"), "w") as f:
    f.write(str(step))
dist.barrier()
dist.destroy_process_group()
