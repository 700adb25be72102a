"""What a snapshot costs the training step (issue 47): the time the step is held by `protect`'s snapshot (the copy
of model + AdamW state into host buffers, node_agent/training/capture.py) against the plain `torch.save` into the
memory directory it replaces (what examples/train_ddp.py did before), alternated in one run, per size of state.
Also the background write's duration and the steps' own time with a snapshot every 5 steps and without.

Run: .venv/bin/python benchmarks/bench_snapshot_blocking.py [--sizes 32,512] [--rounds 10]
     (make bench-snapshot-blocking). --device cuda measures the GPU path (pinned buffers, side stream).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import torch  # noqa: E402
from torch import nn  # noqa: E402

from node_agent.training import rng, snapshot  # noqa: E402
from node_agent.training.capture import Capture  # noqa: E402
from node_agent.training.protection import training_state  # noqa: E402

BASE = "/dev/shm" if os.path.isdir("/dev/shm") else None


def build(mb: int, device: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Linear(W, W) layers whose weights + AdamW's two moments come to about `mb` MiB, one step taken."""
    width = 1024
    layers = max(1, round(mb * 2**20 / (3 * 4 * width * width)))
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step(model, opt, device)
    return model, opt


def step(model: nn.Module, opt: torch.optim.Optimizer, device: str) -> None:
    model(torch.randn(8, 1024, device=device)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    tree = training_state(model, opt, {})
    sizes = [t.numel() * t.element_size() for t in _tensors(tree)]
    return sum(sizes)


def _tensors(tree: object) -> list[torch.Tensor]:
    from node_agent.training.trees import tensors
    return [t for _, t in tensors(tree)]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def held_by_plain_save(model: nn.Module, opt: torch.optim.Optimizer, where: str, n: int, device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    state = {"model": model.state_dict(), "opt": opt.state_dict()}
    snapshot.save(lambda f: torch.save(state, f), n, where=where)
    return time.perf_counter() - t0


def held_by_protect(model: nn.Module, opt: torch.optim.Optimizer, capture: Capture, n: int,
                    device: str) -> tuple[float, float]:
    """(seconds the step is held, seconds until the file is complete)."""
    sync(device)
    t0 = time.perf_counter()
    capture.take(n, {"state": training_state(model, opt, {}), "rng": rng.capture()})
    held = time.perf_counter() - t0
    capture.wait()
    return held, time.perf_counter() - t0


def steps_per_second(model: nn.Module, opt: torch.optim.Optimizer, capture: Capture | str | None, device: str,
                     steps: int = 30, every: int = 5) -> float:
    """With a Capture: protect's snapshots; with a directory: plain torch.save into it; with None: none."""
    sync(device)
    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        step(model, opt, device)
        if isinstance(capture, Capture) and i % every == 0:
            capture.take(i, {"state": training_state(model, opt, {}), "rng": rng.capture()})
        elif isinstance(capture, str) and i % every == 0:
            held_by_plain_save(model, opt, capture, i, device)
    if isinstance(capture, Capture):
        capture.wait()
    sync(device)
    return steps / (time.perf_counter() - t0)


def measure(mb: int, rounds: int, device: str) -> dict[str, object]:
    model, opt = build(mb, device)
    plain_dir = tempfile.mkdtemp(prefix="bench-plain-", dir=BASE)
    ours_dir = tempfile.mkdtemp(prefix="bench-protect-", dir=BASE)
    try:
        capture = Capture(ours_dir)
        first_held, _ = held_by_protect(model, opt, capture, 1, device)      # allocates the buffers
        plain, ours, written = [], [], []
        for n in range(2, rounds + 2):                                        # alternated: A, B, A, B ...
            plain.append(held_by_plain_save(model, opt, plain_dir, n, device))
            held, done = held_by_protect(model, opt, capture, n, device)
            ours.append(held)
            written.append(done)
        rates: dict[str, list[float]] = {"none": [], "plain": [], "protect": []}
        for _ in range(3):
            rates["none"].append(steps_per_second(model, opt, None, device))
            rates["plain"].append(steps_per_second(model, opt, plain_dir, device))
            rates["protect"].append(steps_per_second(model, opt, capture, device))
        size = state_bytes(model, opt)
        return {"state_mb": round(size / 2**20, 1), "device": device, "rounds": rounds,
                "plain_save_s": {"median": statistics.median(plain), "max": max(plain)},
                "protect_held_s": {"median": statistics.median(ours), "max": max(ours), "first": first_held},
                "protect_written_s": {"median": statistics.median(written), "max": max(written)},
                "held_per_gb_s": statistics.median(ours) / (size / 2**30),
                "steps_per_s": {k: statistics.median(v) for k, v in rates.items()}}
    finally:
        shutil.rmtree(plain_dir, ignore_errors=True)
        shutil.rmtree(ours_dir, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="32,512", help="MiB of model + optimizer state, comma-separated")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch's intra-op threads (0: its default)")
    p.add_argument("--json", default="", help="also write the figures to this file")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    out = []
    for mb in (int(s) for s in args.sizes.split(",")):
        r = measure(mb, args.rounds, args.device)
        out.append(r)
        plain, held, written = r["plain_save_s"], r["protect_held_s"], r["protect_written_s"]
        print(f"{r['state_mb']} MiB on {args.device} ({torch.get_num_threads()} torch threads): "
              f"the step is held {held['median'] * 1e3:.1f} ms median "
              f"(max {held['max'] * 1e3:.1f}, first {held['first'] * 1e3:.1f} with its buffers) by protect, "
              f"{plain['median'] * 1e3:.1f} ms (max {plain['max'] * 1e3:.1f}) by torch.save into memory; "
              f"protect's file complete after {written['median'] * 1e3:.1f} ms; "
              f"{r['held_per_gb_s'] * 1e3:.1f} ms held per GiB; steps/s {r['steps_per_s']['none']:.2f} without "
              f"snapshots, {r['steps_per_s']['plain']:.2f} with torch.save every 5, {r['steps_per_s']['protect']:.2f} "
              "with protect every 5", flush=True)
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    assert threading.active_count() == 1, "a snapshot writer outlived the benchmark"


if __name__ == "__main__":
    main()
