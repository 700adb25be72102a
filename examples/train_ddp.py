"""A small real DDP training on CPU (gloo), launched unchanged by torchrun or node-agent.

It reads only what torchrun provides in the environment. `--crash-rank R --crash-step S` makes
global rank R raise once (on the first attempt, TORCHELASTIC_RESTART_COUNT=0) to show recovery.

Snapshots (off unless asked): `--snapshot-every N` is the one call `protect(model, opt, every=N)`: model,
optimizer and RNG states every N optimizer steps into the node agent's memory (kept across worker restarts,
copied to a peer node), and on start every rank resumes from the newest one all ranks hold. `--disk-every M`
also writes a checkpoint into `--ckpt-dir` (rank 0), the fallback when memory holds none (under torchrun, or a
job that lost its copies). A step number is the count of optimizer steps done: a snapshot or checkpoint of step
25 resumes at step 25. `--final FILE` writes the trained weights (rank 0); `--markers FILE` appends timestamped
lines (start, import, cuda, pg, built, loaded, step, crash) for benchmarks/bench_first_step.py. `--device cuda`
trains on the local rank's GPU over NCCL (the CUDA context is made before the process group, as a GPU script
does; on the CPU the `cuda` marker follows `import` at once). `--flip-rank R
--flip-step S` flips one bit of a weight on rank R after step S (first attempt), as silent data corruption
would: protect's digests show the replicas diverged at the next snapshot and the job resumes from the newest
step all held alike; at the end rank 0 says whether every replica's parameters are alike.
"""
from __future__ import annotations

import time

STARTED = time.time()   # the interpreter's first line of ours: a restart's "restart" part ends here

import argparse  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
import zlib  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from node_agent.training import protect  # noqa: E402

IMPORTED = time.time()


def mark(args: argparse.Namespace, what: str, t: float | None = None) -> None:
    if args.markers:
        line = f"{what} {os.environ.get('RANK', '?')} {os.environ.get('TORCHELASTIC_RESTART_COUNT', '?')} " \
               f"{time.time() if t is None else t:.6f}\n"
        with open(args.markers, "a") as f:   # one short append: lines from many processes do not mix
            f.write(line)


def build(args: argparse.Namespace) -> nn.Module:
    if args.width <= 0:
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    layers: list[nn.Module] = []
    for _ in range(args.depth):
        layers += [nn.Linear(args.width, args.width), nn.GELU()]
    return nn.Sequential(*layers)


def reduce_min(x: int, device: torch.device) -> int:
    t = torch.tensor([x], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def load_disk(args: argparse.Namespace, model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """The steps done by the newest disk checkpoint every rank can read (0: none)."""
    held = [int(n[5:-3]) for n in os.listdir(args.ckpt_dir) if n.startswith("step-") and n.endswith(".pt")] \
        if args.ckpt_dir and os.path.isdir(args.ckpt_dir) else []
    step = reduce_min(max(held, default=0), next(model.parameters()).device)
    if step > 0:
        state = torch.load(os.path.join(args.ckpt_dir, f"step-{step}.pt"), mmap=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    print(f"rank {dist.get_rank()}: resumed from step {step} ({'disk' if step else 'scratch'})", flush=True)
    return step


def save_disk(args: argparse.Namespace, model: nn.Module, opt: torch.optim.Optimizer, done: int) -> None:
    if args.disk_every and args.ckpt_dir and done % args.disk_every == 0 and dist.get_rank() == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        final = os.path.join(args.ckpt_dir, f"step-{done}.pt")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, final + ".tmp")
        os.replace(final + ".tmp", final)


@record
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--crash-rank", type=int, default=-1)
    p.add_argument("--crash-step", type=int, default=5)
    p.add_argument("--step-s", type=float, default=0.0, help="seconds each step sleeps (a paced step)")
    p.add_argument("--flip-rank", type=int, default=-1, help="flip one bit of a weight on this rank (first attempt)")
    p.add_argument("--flip-step", type=int, default=0, help="after this step's optimizer step")
    p.add_argument("--alike", action="store_true", help="at the end rank 0 says whether every replica is alike")
    p.add_argument("--snapshot-every", type=int, default=0, help="steps between in-memory snapshots (0: none)")
    p.add_argument("--keep", type=int, default=2, help="in-memory snapshots kept (protect's keep)")
    p.add_argument("--disk-every", type=int, default=0, help="steps between disk checkpoints (0: none)")
    p.add_argument("--ckpt-dir", default="", help="directory of the disk checkpoints")
    p.add_argument("--width", type=int, default=0, help="DEPTH x Linear(WIDTH, WIDTH) (0: a tiny model)")
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--markers", default="", help="append timestamped progress lines to this file")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: the local rank's GPU, over NCCL (the CPU: gloo)")
    p.add_argument("--final", default="", help="write the trained weights to this file (rank 0)")
    p.add_argument("--batches", choices=("seeded", "generator", "global"), default="seeded",
                   help="where each step's batch comes from: a generator seeded by the step (the default), a "
                        "generator of the loop's own (kept by protect in `extra`), or the global RNG")
    args = p.parse_args()
    mark(args, "start", STARTED)
    mark(args, "import", IMPORTED)

    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        torch.empty(1, device=device)       # the CUDA context, made now (its own part of a restart)
    mark(args, "cuda")
    if args.device == "cuda":
        dist.init_process_group("nccl", device_id=device)    # NCCL's communicator now, not at the first collective
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    mark(args, "pg")
    print(f"rank {rank}/{world} (local {os.environ['LOCAL_RANK']}, node group rank {os.environ['GROUP_RANK']}) "
          f"on {socket.gethostname()} pid {os.getpid()}, attempt {restart}, "
          f"master {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", flush=True)

    torch.manual_seed(0)
    model = build(args).to(device)
    batches = torch.Generator().manual_seed(1000 + rank)      # --batches generator: the loop's own
    torch.manual_seed(100 + rank)                              # --batches global: the global RNG, per rank
    opt = (torch.optim.AdamW(model.parameters(), lr=args.lr * 0.01) if args.optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=args.lr))
    mark(args, "built")
    extra = {"batches": batches} if args.batches == "generator" else None
    # DDP before protect: protect then knows the parameters are alike on every rank (and checks)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    start = protect(model, opt, every=args.snapshot_every, extra=extra, keep=args.keep,
                    fallback=lambda: load_disk(args, model.module, opt)) \
        if args.snapshot_every else load_disk(args, model.module, opt)     # memory, a peer's copy, the disk, or 0
    mark(args, "loaded")
    width = args.width if args.width > 0 else 16
    for step in range(start, args.steps):
        shape = (8 if args.width > 0 else 64, width)
        x = (torch.randn(*shape, generator=torch.Generator().manual_seed(step * 1000 + rank))
             if args.batches == "seeded" else torch.randn(*shape, generator=batches) if args.batches == "generator"
             else torch.randn(*shape))
        x = x.to(device)
        y = x if args.width > 0 else x.sum(dim=1, keepdim=True)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == args.flip_rank and step == args.flip_step and restart == 0:
            with torch.no_grad():      # one bit of one weight, as silent data corruption would
                next(model.parameters()).view(-1)[:1].view(torch.int32).bitwise_xor_(1 << 20)
        if rank == args.crash_rank and step == args.crash_step and restart == 0:
            mark(args, "crash")
            raise RuntimeError(f"injected crash on rank {rank} at step {step}")
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if args.step_s:
            time.sleep(args.step_s)
        if step == start:
            if device.type == "cuda":
                torch.cuda.synchronize()      # the step is done when the GPU is, not when it was queued
            mark(args, "step")
        save_disk(args, model.module, opt, step + 1)
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {mean.item() / world:.4f}", flush=True)
    if args.final and rank == 0:
        torch.save(model.module.state_dict(), args.final)
    if args.flip_rank >= 0 or args.alike:     # every replica's parameters, bit for bit: the same on every rank?
        weights = b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())
        crc = torch.tensor([float(zlib.crc32(weights))], dtype=torch.float64, device=device)
        low, high = crc.clone(), crc.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(f"replicas alike at the end: {'yes' if low.item() == high.item() else 'NO'}", flush=True)
    dist.destroy_process_group()
    if rank == 0:
        print(f"training done: {args.steps} steps on {world} workers", flush=True)


if __name__ == "__main__":
    main()
