"""The state the snapshot benchmarks (bench_snapshot_speed.py, restore_phases.py) write and restore: Linear(1024)
layers + AdamW, about `mb` MiB of weights and optimizer state, on `device`. Imported by their child processes,
whichever checkout of node_agent they run."""
from __future__ import annotations

import torch
from torch import nn

WIDTH = 1024


def build(mb: int, device: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    layers = max(1, round(mb * 2**20 / (3 * 4 * WIDTH * WIDTH)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)]).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def step(model: nn.Module, opt: torch.optim.Optimizer, device: str) -> None:
    model(torch.randn(8, WIDTH, device=device)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    sync(device)
