"""DDP (gloo) with DataLoader worker processes, that crashes once while they are alive.

Each rank reads a small dataset through a DataLoader with NUM_WORKERS worker processes (tensors sent
back through shared memory, as DataLoader does); global rank CRASH_RANK raises at step CRASH_STEP on
the first attempt (TORCHELASTIC_RESTART_COUNT=0), while the other ranks, with HOLD=1, wait at that step
(as ranks blocked in a collective do) until the agent stops them. The job then restarts and runs STEPS
steps to the end. What a crash leaves behind is the test's (multiprocessing's pymp-* directories).
"""
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    data = TensorDataset(torch.randn(512, 8), torch.randn(512, 1))
    loader = DataLoader(data, batch_size=8, num_workers=int(os.environ.get("NUM_WORKERS", "2")))
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = int(os.environ.get("STEPS", "12"))
    for step, (x, y) in enumerate(loader):
        if step >= steps:
            break
        if first and step == int(os.environ.get("CRASH_STEP", "5")):
            if rank == int(os.environ.get("CRASH_RANK", "1")):
                raise RuntimeError(f"rank {rank} crashes on purpose at step {step}")
            while os.environ.get("HOLD") == "1":
                time.sleep(1)           # stopped by the agent, its DataLoader workers alive
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
