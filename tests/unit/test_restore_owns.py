"""A restore leaves nothing of the training in the snapshot's file, and lays the optimizer's state out like its
parameters (restored.settle_optimizers, restored.owned): a load keeps a CPU tensor by reference, and the file's private
mapping would hold its /dev/shm pages for the worker's life after the keep rule dropped it; a snapshot holds
tensors contiguous, and a fused optimizer updates a channels-last parameter's state as if laid out like it."""
from __future__ import annotations

import os
import threading

import pytest
import torch
from torch import nn

from node_agent.training import protect, snapshot


class Kept(nn.Linear):
    """A module whose set_extra_state keeps the tensor it is given."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self.kept = torch.arange(4.0)

    def get_extra_state(self) -> dict[str, torch.Tensor]:
        return {"kept": self.kept}

    def set_extra_state(self, state: dict[str, torch.Tensor]) -> None:
        self.kept = state["kept"]


class Keeper:
    """An extra whose load keeps the tensor it is given (as a user's EMA might)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"t": self.t}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.t = state["t"]


OPTIMIZERS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01),
    "lbfgs": lambda p: torch.optim.LBFGS(p, lr=0.1, history_size=4, max_iter=3),   # state: lists of tensors
    "adafactor": lambda p: torch.optim.Adafactor(p, lr=0.01),        # a factored second moment: [8, 1]
}


def job(kind: str, channels_last: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    if channels_last:
        model: nn.Module = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
        return model, torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    model = nn.Sequential(Kept(), nn.ReLU(), nn.Linear(4, 8))
    return model, OPTIMIZERS[kind](model.parameters())


def train(model: nn.Module, opt: torch.optim.Optimizer, start: int, stop: int) -> None:
    for step in range(start, stop):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(2, 3, 6, 6, generator=g) if isinstance(model, nn.Conv2d) else torch.randn(3, 4, generator=g)
        x = x.to(memory_format=torch.channels_last) if x.dim() == 4 else x

        def closure(x: torch.Tensor = x) -> torch.Tensor:
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            return loss
        opt.step(closure)


def private_maps(name: str) -> list[str]:
    """The private mappings of the file (the restore's; a capture of the first run maps it shared)."""
    with open("/proc/self/maps") as f:
        return [line for line in f if name in line and line.split()[1].endswith("p")]


def snapshot_then_restore(memory: str, kind: str, channels_last: bool = False, **extra):
    model, opt = job(kind, channels_last)
    protect(model, opt, every=2, extra=extra.get("first"))
    train(model, opt, 0, 2)
    train(model, opt, 2, 4)                      # the snapshot of step 2 is taken as step 2 begins
    for t in threading.enumerate():
        if t.name.startswith("node-agent snapshot"):
            t.join(30)
    model2, opt2 = job(kind, channels_last)
    assert protect(model2, opt2, every=2, extra=extra.get("second")) == 2
    return (model, opt), (model2, opt2)


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_a_restored_state_keeps_no_part_of_its_snapshot_file_mapped(memory, kind) -> None:
    (model, _), (model2, opt2) = snapshot_then_restore(memory, kind, first={"keeper": Keeper(torch.arange(4.0))},
                                                       second={"keeper": (keeper := Keeper(torch.zeros(4)))})
    assert private_maps(os.path.realpath(snapshot.path(2, memory))) == []
    assert torch.equal(keeper.t, torch.arange(4.0)) and torch.equal(model2[0].kept, torch.arange(4.0))
    train(model2, opt2, 2, 4)                    # and it trains on as the first run did
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values(),
                                                    strict=True) if isinstance(a, torch.Tensor))


def test_a_fused_optimizer_over_a_channels_last_parameter_resumes_exactly(memory) -> None:
    (model, _), (model2, opt2) = snapshot_then_restore(memory, "adam", channels_last=True)
    state = opt2.state[model2.weight]
    assert state["exp_avg"].stride() == model2.weight.stride()       # a snapshot's tensors are contiguous
    train(model2, opt2, 2, 4)
    assert torch.equal(model.weight, model2.weight) and torch.equal(model.bias, model2.bias)


def test_a_parameter_outside_the_model_that_changed_shape_is_refused_not_broadcast(memory, capsys) -> None:
    # A factored state ([4, 1] for a [4, 8] weight) is Adafactor's: allowed only where the snapshot's parameter
    # shapes are the optimizer's. A loss's learned scale, [4, 1] when saved and [4, 8] now, is not one.
    def run(width: int) -> int:
        torch.manual_seed(0)
        model, scale = nn.Linear(8, 4), nn.Parameter(torch.ones(4, width))
        opt = torch.optim.Adam([*model.parameters(), scale], lr=0.01)
        start = protect(model, opt, every=2)
        for _ in range(3):
            (model(torch.ones(2, 8)) * scale.sum()).sum().backward()
            opt.step()
        return start

    assert run(1) == 0
    for t in threading.enumerate():
        if t.name.startswith("node-agent snapshot"):
            t.join(30)
    assert run(8) == 0
    assert "optim's parameters are [[4, 8], [4], [4, 1]] (3) in the snapshot, [[4, 8], [4], [4, 8]] (3) here" \
        in capsys.readouterr().err


def test_an_extra_whose_load_copies_is_loaded_once_from_the_snapshot(memory, monkeypatch) -> None:
    from node_agent.training import restored

    def plain() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8))
        return model, torch.optim.AdamW(model.parameters())

    model, opt = plain()
    ema = torch.optim.swa_utils.AveragedModel(model)
    protect(model, opt, every=2, extra={"ema": ema, "keeper": Keeper(torch.arange(4.0))})
    train(model, opt, 0, 3)
    for t in threading.enumerate():
        if t.name.startswith("node-agent snapshot"):
            t.join(30)
    copied = []
    owned = restored.owned
    monkeypatch.setattr(restored, "owned", lambda tree: copied.append(list(tree) if isinstance(tree, dict) else None)
                        or owned(tree))     # (the keys: a tree kept here would keep the mapping)
    model2, opt2 = plain()
    keeper = Keeper(torch.zeros(4))
    protect(model2, opt2, every=2, extra={"ema": torch.optim.swa_utils.AveragedModel(model2), "keeper": keeper})
    assert [keys for keys in copied if keys and "t" in keys] == [["t"]]         # the keeper's, loaded again
    assert not [keys for keys in copied if keys and "n_averaged" in keys]       # the EMA's: never
    assert private_maps(os.path.realpath(snapshot.path(2, memory))) == []
