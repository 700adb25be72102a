"""A DDP worker that times its own start (for benchmarks/bench_warm_restart.py): when its code began, when
the imports were done, when init_process_group returned, when its first step was done. Global rank 1
crashes on attempt 0 (an uncaught RuntimeError, as a real crash: the interpreter then exits with torch
loaded), stamping the time first, 8 s after its first step so that the agent's zygote is surely ready
(the figures are those of a warm restart). On the next attempt each rank
waits (at most 30 s) for OUT/done, so that the benchmark can read the zygote's memory meanwhile."""
import json
import os
import sys
import time

began = time.time()
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

out, rank, attempt = sys.argv[1], int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
imported = time.time()
dist.init_process_group("gloo")
grouped = time.time()
model = DDP(nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loss = model(torch.randn(8, 16)).sum()
opt.zero_grad()
loss.backward()
opt.step()
stepped = time.time()
with open(os.path.join(out, f"r{rank}-a{attempt}.json"), "w") as f:
    json.dump({"began": began, "imported": imported, "grouped": grouped, "stepped": stepped, "pid": os.getpid(),
               "ppid": os.getppid()}, f)
if attempt == 0 and rank == 1:
    time.sleep(8)
    with open(os.path.join(out, "crash.json"), "w") as f:
        json.dump({"crash": time.time()}, f)
    raise RuntimeError("injected crash")
dist.barrier()   # attempt 0: rank 0 waits here until it is stopped
deadline = time.time() + 30
while attempt > 0 and not os.path.exists(os.path.join(out, "done")) and time.time() < deadline:
    time.sleep(0.05)
dist.destroy_process_group()
