"""A gloo DDP training that knows nothing of node-agent (benchmarks/bench_progress.py runs it unchanged under
node-agent and torchrun). It logs its own step times, OUT_DIR/steps-RANK.txt ("unix_time step restart" per
line), so a benchmark can compare what the launcher saw with what the script did. Settings (environment):

  STEPS=N or DURATION_S=S      how long to train (per attempt)
  WORK=K                       matmuls of 192x192 per step (the compute); SLOW_RANKS=2,3 do 3x as many
  JITTER=0.5                   each step's compute varies by +-50 %
  EVAL_EVERY=50 EVAL_STEPS=20  an eval phase (forward passes, no collective) of that many steps' compute
  CKPT_EVERY=200 CKPT_S=30     every rank writes a checkpoint (real writes) for that long
  DATA_STALL_EVERY=N           about one batch in N takes 3 steps' time (STEP_S_GUESS) to load, in a real
                               DataLoader worker process
  FINISH_SPREAD_S=S            after the last step, rank r works r x S more before it exits
  FAULT=sleep|stop|spin|exit0|crash|deadlock FAULT_RANK=R FAULT_STEP=N   on the first attempt only (deadlock:
                               every other rank enters a barrier, FAULT_RANK a recv from rank 0 that never comes)
  SOLO=http|poll|metrics|torchops|numpy|save|dataloader|eval SOLO_RANK=R SOLO_AT=20,40 SOLO_S=60
                               legitimate work alone on rank R for SOLO_S before each of those steps, on every
                               attempt, while the others wait in the next collective (SOLO_URL: the slow HTTP
                               service); OUT_DIR/solo-R-STEP holds the unix time it began
  GATHERS=N GATHER_MB=M        after step 10, every rank all-gathers M MB chunks N times (no step meanwhile)
  DEVICE=cuda BACKEND=nccl     the model, the compute and SOLO=kernel on the GPU (local rank modulo the GPUs:
                               on one GPU every rank shares it, with gloo moving CUDA tensors); BACKEND: gloo
  SOLO=kernel                  rank R waits in torch.cuda.synchronize for SOLO_S of CUDA kernels (its GPU busy)
"""
import collections
import os
import random
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

env = os.environ.get
out = env("OUT_DIR", ".")
device = env("DEVICE", "cpu")
if device == "cuda":
    torch.cuda.set_device(int(env("LOCAL_RANK", "0")) % torch.cuda.device_count())
dist.init_process_group(env("BACKEND", "gloo"))
rank = dist.get_rank()
restart = int(env("TORCHELASTIC_RESTART_COUNT", "0"))
fault = env("FAULT", "") if restart == 0 else ""
fault_rank, fault_step = int(env("FAULT_RANK", "-1")), int(env("FAULT_STEP", "30"))
slow = str(rank) in env("SLOW_RANKS", "").split(",")
work = int(env("WORK", "8")) * (3 if slow else 1)
jitter = float(env("JITTER", "0"))
random.seed(rank * 1000 + restart)
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                                   torch.nn.Linear(64, 1)).to(device))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
weights = torch.randn(192, 192, device=device) / 14


def compute(units: float) -> None:
    x = torch.randn(192, 192, device=device)
    for _ in range(max(1, round(units))):
        x = torch.tanh(x @ weights)


class Batches(torch.utils.data.Dataset):
    """Random batches; about one in DATA_STALL_EVERY is slow to load."""

    def __len__(self) -> int:
        return 10 ** 9

    def __getitem__(self, i: int) -> torch.Tensor:
        if solo == "dataloader" and rank == solo_rank and i in solo_at:   # one item takes SOLO_S to load
            began(i)
            time.sleep(solo_s)
        every = int(env("DATA_STALL_EVERY", "0"))
        if every and random.random() < 1 / every:
            time.sleep(3 * float(env("STEP_S_GUESS", "0.1")))
        return torch.randn(16, 64)


solo, solo_rank = env("SOLO", ""), int(env("SOLO_RANK", "0"))
solo_at, solo_s = {int(x) for x in env("SOLO_AT", "20,40").split(",") if x}, float(env("SOLO_S", "60"))


def began(step_: int) -> None:
    with open(os.path.join(out, f"solo-{rank}-{step_}"), "w") as f:
        f.write(f"{time.time():.6f}")


def alone(step_: int) -> None:
    """SOLO_S of work on this rank alone, of the kind SOLO names (the others wait in the next collective)."""
    began(step_)
    end = time.time() + solo_s
    if solo == "http":                      # a checkpoint upload to a service that answers late
        import urllib.request
        with urllib.request.urlopen(env("SOLO_URL"), timeout=solo_s + 120) as resp:
            resp.read()
    elif solo == "poll":                    # waiting for a signal from outside the job
        flag = os.path.join(out, f"go-{rank}-{step_}")
        import subprocess
        subprocess.Popen(["sh", "-c", f"sleep {solo_s}; touch {flag}"])
        while not os.path.exists(flag):
            time.sleep(1)
    elif solo == "metrics":                 # n-gram counting in pure Python, as BLEU/ROUGE code does
        words = [str(random.randrange(500)) for _ in range(20000)]
        while time.time() < end:
            counts = collections.Counter(tuple(words[i:i + 4]) for i in range(len(words) - 4))
            sum(counts.values())
    elif solo == "torchops":                # a hand-written loop of torch ops, no nn.Module
        x, w = torch.randn(256, 256), torch.randn(256, 256) / 16
        while time.time() < end:
            x = torch.tanh(x @ w)
    elif solo == "numpy":
        import numpy as np
        a = np.random.rand(300, 300)
        while time.time() < end:
            a = np.tanh(a @ a) / 300
    elif solo == "save":                    # torch.save with fsync, again and again
        state = {"w": torch.randn(1024, 1024)}
        path = os.path.join(out, f"solo-ckpt-{rank}.pt")
        while time.time() < end:
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
    elif solo == "eval":                    # an evaluation through nn.Module
        with torch.no_grad():
            while time.time() < end:
                model.module(torch.randn(256, 64, device=device))
    elif solo == "kernel":                  # long CUDA kernels queued at once, then waited for (GPU busy)
        began_at = time.time()
        torch.cuda._sleep(10 ** 8)
        torch.cuda.synchronize()
        per = max(1e-4, time.time() - began_at)
        for _ in range(int(solo_s / per)):
            torch.cuda._sleep(10 ** 8)
        torch.cuda.synchronize()


def checkpoint(seconds: float) -> None:
    """Real writes for that long, about 25 MB/s per rank (a disk's share, not the page cache's speed)."""
    end = time.time() + seconds
    block = os.urandom(1 << 18)
    with open(os.path.join(out, f"ckpt-{rank}.bin"), "wb") as f:
        while time.time() < end:
            f.write(block)
            f.flush()
            time.sleep(0.01)


log = open(os.path.join(out, f"steps-{rank}.txt"), "a")  # noqa: SIM115 - the run's own log, open for its life
steps, duration = int(env("STEPS", "0")), float(env("DURATION_S", "0"))
eval_every, eval_steps = int(env("EVAL_EVERY", "0")), int(env("EVAL_STEPS", "20"))
ckpt_every, ckpt_s = int(env("CKPT_EVERY", "0")), float(env("CKPT_S", "30"))
batches = iter(torch.utils.data.DataLoader(Batches(), batch_size=None, num_workers=1, prefetch_factor=1))
gathers = int(env("GATHERS", "0"))
started = time.time()
step = 0


def go_on() -> bool:
    """Steps, or the duration: decided together every 20 steps (ranks must stop at the same step)."""
    if steps:
        return step < steps
    if step % 20:
        return True
    over = torch.tensor([float(time.time() - started >= duration)])
    dist.all_reduce(over, op=dist.ReduceOp.MAX)
    return not over.item()


while go_on():
    if fault and rank == fault_rank and step == fault_step:
        with open(os.path.join(out, f"faulted-{rank}"), "w") as f:
            f.write(f"{time.time():.6f} {os.getpid()}")
        if fault == "sleep":
            time.sleep(10 ** 6)
        elif fault == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault == "spin":
            while True:
                pass
        elif fault == "exit0":
            sys.exit(0)
        elif fault == "crash":
            raise RuntimeError(f"injected crash at step {step}")
    if fault == "deadlock" and step == fault_step:
        if rank == fault_rank:
            dist.recv(torch.zeros(1, device=device), src=0)
        else:
            dist.barrier()
    if solo and solo != "dataloader" and rank == solo_rank and step in solo_at:
        alone(step)
    if gathers and step == 10:
        began(step)
        chunk = torch.ones(int(float(env("GATHER_MB", "8")) * (1 << 18)))
        parts = [torch.empty_like(chunk) for _ in range(dist.get_world_size())]
        for _ in range(gathers):          # every rank in all_gather, data moving, no step
            dist.all_gather(parts, chunk)
        with open(os.path.join(out, f"gathered-{rank}"), "w") as f:
            f.write(f"{time.time():.6f}")
    if eval_every and step and step % eval_every == 0:
        with torch.no_grad():
            compute(work * eval_steps)
    if ckpt_every and step and step % ckpt_every == 0:
        checkpoint(ckpt_s)
    compute(work * (1 + random.uniform(-jitter, jitter)))
    loss = model(next(batches).to(device)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    log.write(f"{time.time():.6f} {step} {restart}\n")
    log.flush()
dist.barrier()
time.sleep(rank * float(env("FINISH_SPREAD_S", "0")))
log.close()
dist.destroy_process_group()
