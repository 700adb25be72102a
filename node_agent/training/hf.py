"""In-memory snapshots for transformers' Trainer (and accelerate under it), in one line after building it:

    from node_agent.training.hf import protect_trainer
    trainer = Trainer(model=model, args=args, train_dataset=data)
    protect_trainer(trainer, every=5)
    trainer.train()

Every `every` optimizer steps (`state.global_step`) a TrainerCallback takes what the Trainer's own checkpoint
holds (model weights, optimizer, LR scheduler, grad scaler, RNG states, trainer state) into the node agent's
memory, where the Trainer's own checkpoint is written: after the step's logging, evaluation and save (an
evaluation draws from the RNG: the next step's dropout follows it), as the next step or epoch begins. When
`train()` starts with no `resume_from_checkpoint` of yours, the newest snapshot every rank holds is laid out
as a checkpoint folder in memory and handed to the Trainer's own resume: the global step, the epoch and the
batches already seen follow, as with `train(resume_from_checkpoint=...)`. A folder you pass wins. The
rules of `protect` hold (checksums, every rank on one step, nothing under torchrun); the model's keys and shapes
are checked before the Trainer loads anything."""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState

from node_agent.training import ddp_buckets, restored, resume, rng, trees
from node_agent.training.capture import Capture, check_cadence

FOLDER = ".resume"     # the checkpoint folder laid out for the Trainer, in the memory directory until it is read


def protect_trainer(trainer: Trainer, every: int = 5, keep: int = 2) -> Snapshots:
    """Add the snapshots to `trainer` and make its `train()` resume from the newest one (see above)."""
    if not isinstance(trainer, Trainer):
        raise TypeError(f"protect_trainer(trainer=...): a {type(trainer).__qualname__} is not a transformers Trainer")
    # Twice, two captures wrote the same step's file (one of them failed each snapshot) and two resumes were laid out
    if any(isinstance(cb, Snapshots) for cb in trainer.callback_handler.callbacks):
        raise ValueError("protect_trainer(trainer): this Trainer is protected already; call protect_trainer once")
    callback = Snapshots(trainer, every, keep)
    trainer.add_callback(callback)
    train = trainer.train

    @functools.wraps(train)
    def train_from_snapshot(resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        callback.fit = resume.next_fit()
        if resume_from_checkpoint in (None, False):
            resume_from_checkpoint = callback.lay_out()
        return train(resume_from_checkpoint, *args, **kwargs)

    trainer.train = train_from_snapshot
    return callback


class Snapshots(TrainerCallback):
    def __init__(self, trainer: Trainer, every: int = 5, keep: int = 2) -> None:
        check_cadence("protect_trainer", every, keep)
        self.trainer, self.every = trainer, every
        where = resume.memory_directory()
        self._capture = Capture(where, keep, self._replicated) if where is not None else None
        self._params: set[str] | None = None
        self._last = -1
        self._due: int | None = None       # the step whose snapshot is taken once its evaluation and save are done
        self._folder: str | None = None
        self._prepared = False       # Capture.prepare called
        self._buckets: Any = None     # the resumed snapshot's DDP bucket layout, adopted once DDP is built
        self._adopt = False
        self.fit = 0                  # this process's how-manieth train() (resume.FIT)

    def lay_out(self) -> str | None:
        """The newest snapshot every rank holds, as a checkpoint folder the Trainer resumes from (None: none)."""
        # Every rank takes part in the agreement, one without a memory directory too (its node's --no-memory-dir)
        if not resume.everywhere(self._capture.where if self._capture is not None else None) or self._capture is None:
            return None
        where = self._capture.where
        model = self.trainer.model      # None until train() when the Trainer has a model_init: its own load checks
        live = model.state_dict() if model is not None else None
        args = self.trainer.args
        found = resume.agree(where, lambda tree: resume.other_fit(tree, self.fit) or (     # a rank without the step
            trees.mismatch(tree.get("model"), live, "model") if live else None), replicas=self._ddp())  # is lent one
        if found is None:
            return None
        step, tree, lender = found
        folder = os.path.join(where, FOLDER)
        shutil.rmtree(folder, ignore_errors=True)
        os.mkdir(folder, 0o700)
        torch.save(tree["model"], os.path.join(folder, "pytorch_model.bin"))
        torch.save(tree["optimizer"], os.path.join(folder, "optimizer.pt"))
        torch.save(tree["scheduler"], os.path.join(folder, "scheduler.pt"))
        if "scaler" in tree:
            torch.save(tree["scaler"], os.path.join(folder, "scaler.pt"))
        if lender == resume.rank():      # a lent rank keeps its own RNG states (the lender's would draw its batches)
            torch.save(_hf_rng(tree["rng"]), os.path.join(folder, f"rng_state_{args.process_index}.pth"
                                                          if args.world_size > 1 else "rng_state.pth"))
        else:
            resume.lent(step, lender, "a replica's model, optimizer and scheduler; its RNG states start as the "
                                      "Trainer set them")
        with open(os.path.join(folder, "trainer_state.json"), "w") as f:
            f.write(tree["trainer_state"])
        self._folder, self._last = folder, step
        self._buckets, self._adopt = tree.get("ddp_buckets"), True     # every rank, as every rank agreed
        resume.resumed(step)
        return folder

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        self._due = None       # one left by a train() that raised is not this one's
        if self._folder is not None:         # the Trainer has loaded the optimizer from the snapshot
            restored.settle_optimizers([self.trainer.optimizer], set())
        if self._capture is not None:
            trees.refuse_unplain(self._tree(state), "protect_trainer: the Trainer's state ")

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                              **kwargs: Any) -> None:
        if self._capture is not None:
            self._capture.before_update()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if self._folder is not None:      # the Trainer has read it (the RNG file last, before this first step)
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
        step = state.global_step
        # Not the last step's (max_steps): the Trainer's resume runs one step past a checkpoint of it (no check
        # before its first step), so a worker failing after train() returned would end past the run
        last = 0 < args.max_steps <= step
        if self._capture is not None and step > self._last and step % self.every == 0 and not last:
            self._last = self._due = step      # taken by _take_due: the Trainer's evaluation and save come first
        elif self._capture is not None and not self._prepared and self.trainer.optimizer is not None \
                and self.trainer.optimizer.state:       # the first snapshot's buffers, ahead
            self._prepared = True
            self._capture.prepare(self._tree(state), [self.trainer.optimizer])

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        self._take_due(state)       # the RNG states as the Trainer's resume loads them: after the step's batches

    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        if self._adopt:     # the first hook after the Trainer built its DDP (after on_train_begin), before a step
            self._adopt = False
            if (ddp := self._wrapped_ddp()) is not None:
                ddp_buckets.adopt(ddp, self._buckets)   # its first step sums as the uninterrupted run's did
        self._take_due(state)       # before the epoch's iterator draws its seed (the Trainer loads them before)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self._take_due(state)
        if self._capture is not None:
            self._capture.wait()

    def _take_due(self, state: TrainerState) -> None:
        """The snapshot of the step last done, where the Trainer's own checkpoint would hold it: after its
        `_maybe_log_save_evaluate` (a rank that fails in an evaluation resumes from the snapshot before, and the
        evaluation is done again, as from the Trainer's own checkpoint)."""
        due, self._due = self._due, None
        if due is not None and self._capture is not None:
            self._capture.take(due, self._tree(state), [o for o in [self.trainer.optimizer] if o is not None])

    def _replicated(self, path: str) -> bool:
        """Under DDP (several processes, neither FSDP nor DeepSpeed) every rank holds the model's parameters
        alike: their digests go to the server, which compares the replicas (rdzv_server/core/divergence.py)."""
        if self._params is None:
            model = self.trainer.model
            self._params = {f"/model/{name}" for name, _ in model.named_parameters()} \
                if self._ddp() and model is not None else set()
        return path in self._params

    def _ddp(self) -> bool:
        """Several processes, neither FSDP nor DeepSpeed (set in the arguments, or by accelerate's config)."""
        t, args = self.trainer, self.trainer.args
        sharded = args.fsdp or args.deepspeed or getattr(t, "is_fsdp_enabled", False) or \
            getattr(t, "is_deepspeed_enabled", False)
        return args.world_size > 1 and not sharded

    def _tree(self, trainer_state: TrainerState) -> dict[str, Any]:
        """What the Trainer's own checkpoint holds (its `_save_checkpoint`), as one tree."""
        t = self.trainer
        assert t.model is not None and t.optimizer is not None and t.lr_scheduler is not None   # built by train()
        tree: dict[str, Any] = {"model": t.model.state_dict(), "optimizer": t.optimizer.state_dict(),
                                "scheduler": t.lr_scheduler.state_dict(), "rng": rng.capture(),
                                "trainer_state": _trainer_state_json(t, trainer_state), resume.FIT: self.fit}
        scaler = getattr(t.accelerator, "scaler", None)
        if scaler is not None:
            tree["scaler"] = scaler.state_dict()
        if (ddp := self._wrapped_ddp()) is not None and (buckets := ddp_buckets.recorded(ddp)) is not None:
            tree["ddp_buckets"] = buckets     # DDP's rebuilt layout (find_unused_parameters=False): ddp_buckets.py
        return tree

    def _wrapped_ddp(self) -> Any:
        wrapped = getattr(self.trainer, "model_wrapped", None)
        return wrapped if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel) else None


def _trainer_state_json(trainer: Trainer, trainer_state: TrainerState) -> str:
    saved = dataclasses.asdict(trainer_state)
    callbacks: dict[str, Any] = {}
    for cb in [*trainer.callback_handler.callbacks, trainer.control]:
        if isinstance(cb, ExportableState):
            name = type(cb).__name__
            callbacks[name] = [*callbacks[name], cb.state()] if isinstance(callbacks.get(name), list) \
                else ([callbacks[name], cb.state()] if name in callbacks else cb.state())
    saved["stateful_callbacks"] = callbacks
    return json.dumps(saved, indent=2, sort_keys=True) + "\n"


def _hf_rng(saved: dict[str, Any]) -> dict[str, Any]:
    """Our RNG states in the layout of the Trainer's rng_state file."""
    out: dict[str, Any] = {"python": saved["python"], "cpu": saved["torch"]}
    if "numpy" in saved:
        n = saved["numpy"]
        out["numpy"] = (n["kind"], n["keys"].numpy(), n["pos"], n["has_gauss"], n["cached"])
    if "cuda" in saved:
        out["cuda"] = saved["cuda"]
    return out
