"""A small gloo DDP training that knows nothing of node-agent, with a fault on one rank (first attempt only).

FAULT=sleep|stop|spin|exit0 on rank FAULT_RANK before step FAULT_STEP: it sleeps forever (SLEEP_IGNORES_TERM=1:
SIGTERM ignored too), stops itself (SIGSTOP), spins in a Python loop, or exits 0 while the others go on.
FAULT=deadlock: before step FAULT_STEP every rank but FAULT_RANK enters a barrier while FAULT_RANK waits in a recv
from rank 0 that never comes. FAULT=solo: on every attempt, rank FAULT_RANK sleeps SOLO_S alone before step
FAULT_STEP while the others wait in the next collective (a slow upload): legitimate work.
FAULT=busy: every EVAL_EVERY steps all ranks evaluate for EVAL_S (forward passes, no collective), then rank 0
alone writes a "checkpoint" for BUSY_S (real writes) while the others wait at a barrier: nothing is hung.
Writes OUT_DIR/started-<rank>-<restart> (its pid) and OUT_DIR/faulted-<rank> (its pid) at the fault; runs STEPS
steps per attempt, then exits 0.
"""
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

out = os.environ["OUT_DIR"]
rank = int(os.environ["RANK"])
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
fault = os.environ.get("FAULT", "") if restart == 0 or os.environ.get("FAULT") == "solo" else ""
fault_rank, fault_step = int(os.environ.get("FAULT_RANK", "-1")), int(os.environ.get("FAULT_STEP", "10"))
steps = int(os.environ.get("STEPS", "30"))


def mark(name: str) -> None:
    path = os.path.join(out, name)
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(path + ".tmp", path)


def checkpoint(seconds: float) -> None:
    """Real writes for `seconds`: a rank that moves data is computing, not hung."""
    end = time.time() + seconds
    with open(os.path.join(out, f"ckpt-{rank}"), "wb") as f:
        while time.time() < end:
            f.write(os.urandom(1 << 16))
            f.flush()
            os.fsync(f.fileno())


dist.init_process_group("gloo")
mark(f"started-{rank}-{restart}")
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(steps):
    if fault and rank == fault_rank and step == fault_step:
        mark(f"faulted-{rank}")
        if fault == "sleep":
            if os.environ.get("SLEEP_IGNORES_TERM"):
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            time.sleep(10 ** 6)
        elif fault == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault == "spin":
            while True:
                pass
        elif fault == "exit0":
            sys.exit(0)
    if fault == "deadlock" and step == fault_step:
        if rank == fault_rank:
            dist.recv(torch.zeros(1), src=0)
        else:
            dist.barrier()
    if fault == "solo" and rank == fault_rank and step == fault_step:
        time.sleep(float(os.environ.get("SOLO_S", "15")))
    if fault == "busy" and step and step % int(os.environ.get("EVAL_EVERY", "10")) == 0:
        end = time.time() + float(os.environ.get("EVAL_S", "7"))
        with torch.no_grad():
            while time.time() < end:
                model.module(torch.randn(256, 32))
        if rank == 0:
            checkpoint(float(os.environ.get("BUSY_S", "7")))
        dist.barrier()
    loss = model(torch.randn(16, 32)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.02)
dist.destroy_process_group()
