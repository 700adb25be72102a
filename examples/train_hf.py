"""A small transformers Trainer job on CPU (gloo): a 2-layer GPT-2 built from its config (nothing downloaded),
launched unchanged by torchrun or node-agent, with in-memory snapshots in one line:
`protect_trainer(trainer, every=N)` (`--snapshot-every N`).

    node-agent --nnodes 2 --nproc 2 ... examples/train_hf.py --snapshot-every 5

`--crash-rank R --crash-step S` makes global rank R raise once (first attempt) when S optimizer steps are done.
`--disk-every M --ckpt-dir D` adds the Trainer's own checkpoints every M steps, and a restarted job resumes from
the newest with `train(resume_from_checkpoint=...)` (the comparison in tests/e2e/test_framework_snapshots.py).
`--final FILE` writes the trained weights (rank 0); `--step-s S` makes each step sleep S seconds (a paced job)."""
from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from node_agent.training.hf import protect_trainer


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int, length: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class CrashAndSay(TrainerCallback):
    def __init__(self, crash_rank: int, crash_step: int, step_s: float = 0.0) -> None:
        self.crash_rank, self.crash_step, self.step_s = crash_rank, crash_step, step_s

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.step_s:
            time.sleep(self.step_s)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        print(f"rank {args.process_index}: training from step {state.global_step} (epoch {state.epoch or 0:.2f})",
              flush=True)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if (args.process_index == self.crash_rank and state.global_step == self.crash_step
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
            raise RuntimeError(f"injected crash on rank {args.process_index} at step {state.global_step}")


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

    # (GPT-2's bos/eos ids, 50256, lie outside this vocabulary: transformers warns of each, on every rank)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                        eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    disk = bool(args.disk_every)
    training = TrainingArguments(
        output_dir=args.ckpt_dir or "/tmp/train_hf_unused", max_steps=args.steps, per_device_train_batch_size=4,
        learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=3, seed=0, use_cpu=True, ddp_backend="gloo",
        save_strategy="steps" if disk else "no", save_steps=args.disk_every or 500, report_to=[],
        logging_steps=1000, disable_tqdm=True, dataloader_num_workers=0,
        ddp_find_unused_parameters=False)     # every parameter is used: DDP need not look (and warns if told to)
    trainer = Trainer(model=model, args=training, train_dataset=Tokens(96, 16, 64),
                      callbacks=[CrashAndSay(args.crash_rank, args.crash_step, args.step_s)])
    if args.snapshot_every:
        protect_trainer(trainer, every=args.snapshot_every)      # the one line
    last = get_last_checkpoint(args.ckpt_dir) if disk and os.path.isdir(args.ckpt_dir) else None
    trainer.train(resume_from_checkpoint=last)
    if args.final and training.process_index == 0:
        torch.save(trainer.model.state_dict(), args.final)
        print(f"training done: {trainer.state.global_step} steps", flush=True)


if __name__ == "__main__":
    main()
