"""A small Lightning DDP training on CPU (gloo), launched unchanged by torchrun or node-agent, with in-memory
snapshots in one line: `callbacks=[Snapshots(every=N)]` (`--snapshot-every N`).

    node-agent --nnodes 2 --nproc 2 ... examples/train_lightning.py --snapshot-every 5

`--crash-rank R --crash-step S` makes global rank R raise once (first attempt) when S optimizer steps are done.
`--disk-every M --ckpt-dir D` adds Lightning's own ModelCheckpoint every M steps, and a restarted job resumes from
its newest file with `fit(ckpt_path=...)` (the comparison in tests/e2e/test_framework_snapshots.py).
`--final FILE` writes the trained weights (rank 0); `--step-s S` paces each step."""
from __future__ import annotations

import argparse
import os
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from node_agent.training.lightning import Snapshots


class Regression(L.LightningModule):
    def __init__(self, crash_rank: int, crash_step: int, step_s: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
        self.crash_rank, self.crash_step, self.step_s = crash_rank, crash_step, step_s

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if (self.global_rank == self.crash_rank and self.global_step == self.crash_step
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
            raise RuntimeError(f"injected crash on rank {self.global_rank} at step {self.global_step}")
        time.sleep(self.step_s)      # a paced step (--step-s), for the tests that act while it trains
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> dict[str, object]:
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)}


class SayFirstStep(Callback):
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        print(f"rank {trainer.global_rank}: training from step {trainer.global_step} "
              f"(epoch {trainer.current_epoch})", flush=True)


def newest_checkpoint(folder: str) -> str | None:
    held = [n for n in os.listdir(folder) if n.endswith(".ckpt")] if folder and os.path.isdir(folder) else []
    return os.path.join(folder, max(held, key=lambda n: int(n.split("step=")[1].split(".")[0]))) if held else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--crash-rank", type=int, default=-1)
    p.add_argument("--crash-step", type=int, default=27)
    p.add_argument("--snapshot-every", type=int, default=0)
    p.add_argument("--disk-every", type=int, default=0)
    p.add_argument("--ckpt-dir", default="")
    p.add_argument("--final", default="")
    p.add_argument("--step-s", type=float, default=0.0, help="seconds each step sleeps")
    args = p.parse_args()

    L.seed_everything(0, workers=True, verbose=False)
    data = TensorDataset(torch.randn(96, 16, generator=torch.Generator().manual_seed(1)),
                         torch.randn(96, 1, generator=torch.Generator().manual_seed(2)))
    callbacks: list[Callback] = [SayFirstStep()]
    if args.snapshot_every:
        callbacks.append(Snapshots(every=args.snapshot_every))       # the one line
    if args.disk_every:
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=args.disk_every, save_top_k=-1,
                                         filename="{step}"))
    nodes = int(os.environ.get("WORLD_SIZE", "1")) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), num_nodes=nodes,
                        strategy="ddp", max_steps=args.steps, callbacks=callbacks, logger=False,
                        enable_checkpointing=bool(args.disk_every), enable_progress_bar=False,
                        enable_model_summary=False, deterministic=True)
    model = Regression(args.crash_rank, args.crash_step, args.step_s)
    loader = DataLoader(data, batch_size=4, shuffle=True)
    trainer.fit(model, loader, ckpt_path=newest_checkpoint(args.ckpt_dir) if args.disk_every else None)
    if args.final and trainer.global_rank == 0:
        torch.save(model.state_dict(), args.final)
        print(f"training done: {trainer.global_step} steps", flush=True)


if __name__ == "__main__":
    main()
