"""Lightning's restore from a snapshot keeps no part of the snapshot's file mapped (resume.copy_out): its optimizer
load keeps CPU tensors by reference, which would hold the file's /dev/shm pages for the worker's life."""
from __future__ import annotations

import os

import lightning.pytorch as L
import torch
from torch import nn

from node_agent.training import snapshot


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(16, 16)

    def training_step(self, batch, _):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fit(steps: int) -> L.Trainer:
    from node_agent.training.lightning import Snapshots
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 16)), batch_size=8)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=[Snapshots(every=2)], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Tiny(), data)
    return trainer


def test_a_lightning_restore_keeps_no_part_of_its_snapshot_file_mapped(memory, capsys) -> None:
    fit(4)
    name = os.path.realpath(snapshot.path(4, memory))
    second = fit(6)             # resumes at step 4
    assert "resumed from step 4 (memory)" in capsys.readouterr().out
    with open("/proc/self/maps") as f:       # private: the restore's (the first fit's capture maps it shared)
        assert [line for line in f if name in line and line.split()[1].endswith("p")] == []
    assert second.global_step == 6
