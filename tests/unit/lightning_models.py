"""Lightning modules and a fit for tests/unit/test_lightning_mapping.py, apart so that pytest collecting that module
imports no Lightning (~3 s of CPU in every xdist worker of `make test`, most of which never runs its tests)."""
from __future__ import annotations

import lightning.pytorch as L
import torch
from torch import nn

from node_agent.training import resume
from node_agent.training.lightning import Snapshots


class SparseSum(torch.optim.SGD):
    """SGD that also keeps a sparse running sum of its gradients (state without a plain storage)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                acc = self.state[p].get("acc")
                self.state[p]["acc"] = p.grad.to_sparse() if acc is None else (acc + p.grad.to_sparse()).coalesce()
        return loss


class Counted(torch.optim.SGD):
    """SGD that keeps a global step count under a key of its own (not a parameter's), a tensor updated in place."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        self.state.setdefault("t", torch.zeros(())).add_(1)
        return loss


class Tiny(L.LightningModule):
    def __init__(self, optimizer: str = "adamw") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(16, 16)
        self.optimizer = optimizer

    def training_step(self, batch, _):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        if self.optimizer == "sparse":
            return SparseSum(self.parameters(), lr=0.01)
        if self.optimizer == "counted":
            return Counted(self.parameters(), lr=0.01)
        opt = torch.optim.AdamW(self.parameters(), lr=torch.tensor(1e-3))      # a tensor lr: the scheduler's too
        return {"optimizer": opt,
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.9), "interval": "step"}}


def fit(steps: int, optimizer: str = "adamw", ckpt: str | None = None) -> L.Trainer:
    resume._fits[0] = 0          # as a new process's first fit
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 16)), batch_size=8)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=[Snapshots(every=2)], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Tiny(optimizer), data, ckpt_path=ckpt)
    return trainer


class Gan(L.LightningModule):
    """Manual optimization with two optimizers: `global_step` moves once per `step()` called, 2 a batch, and 1 on
    the first batch (the discriminator warms up alone), so every step after it is odd."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.g, self.d = nn.Linear(4, 4), nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        g, d = self.optimizers()
        d.zero_grad()
        self.manual_backward(self.d(batch[0]).mean() - self.d(self.g(batch[0]).detach()).mean())
        d.step()
        if batch_idx > 0:
            g.zero_grad()
            self.manual_backward(self.d(self.g(batch[0])).mean())
            g.step()

    def configure_optimizers(self):
        return torch.optim.Adam(self.g.parameters(), 1e-2), torch.optim.Adam(self.d.parameters(), 1e-2)
