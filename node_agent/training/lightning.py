"""In-memory snapshots for Lightning, in one line:

    from node_agent.training.lightning import Snapshots
    trainer = L.Trainer(..., callbacks=[Snapshots(every=5)])

Every `every` optimizer steps (Lightning's `global_step`) the callback takes the checkpoint Lightning itself would
write (`dump_checkpoint`: model, optimizers, LR schedulers, loops, callbacks, precision) into the node agent's
memory, at the end of the first batch whose global step reached or passed a multiple of `every` (with several
optimizers it moves more than one a batch), dumped where a ModelCheckpoint saves, kept once it has saved.
When `fit` starts it hands the newest
snapshot every rank holds to Lightning's own restore, as `fit(ckpt_path=...)` would: the global step, the epoch
and the position in it follow. A `ckpt_path` you pass wins. The rules of `protect` hold (checksums, every rank on
one step, nothing under torchrun); the model's keys and shapes are checked before Lightning loads anything (the
optimizers do not exist yet: Lightning's own load checks them). The
hyper-parameters are not kept (Lightning needs them to build a model from a file, not to resume one)."""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from node_agent.training import restored, resume, trees, upload
from node_agent.training.capture import Capture, check_cadence, say

NOT_KEPT = ("hyper_parameters", "hparams_name", "hparams_type", "datamodule_hyper_parameters",
            "datamodule_hparams_name", "datamodule_hparams_type")


class Snapshots(Callback):
    def __init__(self, every: int = 5, keep: int = 2) -> None:
        check_cadence("Snapshots", every, keep)
        self.every, self.keep = every, keep
        self._capture: Capture | None = None
        self._last = -1
        self._restored: int | None = None
        self._prepared = False       # Capture.prepare called
        self._mapped: set[int] = set()       # where the snapshot's tensors lie (restored.settle_optimizers)
        self._said = False           # the resume from the snapshot said (_loaded)
        self._fit = 0                # this process's how-manieth fit (resume.FIT)
        self._due: tuple[int, dict[str, Any]] | None = None     # dumped at the batch's end, taken after the saves

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Before Lightning restores (the process group is up, the optimizers not yet built)."""
        if stage != "fit":
            return
        # Two would write the same steps' files in one memory directory and each hand a resume to Lightning
        if (many := sum(isinstance(cb, Snapshots) for cb in trainer.callbacks)) > 1:
            raise ValueError(f"Snapshots: the Trainer's callbacks hold {many} Snapshots callbacks; keep one")
        self._restored, self._said, self._prepared = None, False, False     # this fit's own
        self._fit, self._due = resume.next_fit(), None
        where = resume.memory_directory()
        everywhere = resume.everywhere(where)       # every rank takes part in the agreement, one without memory too
        if where is None:
            return
        replicated = _replicated(trainer, pl_module)
        self._capture = Capture(where, self.keep, replicated)
        # Under DDP a rank without the step (a node that joined a growing job) is lent a replica's: Lightning's own
        # checkpoint is one file every rank loads, so that is what fit(ckpt_path=...) would have done.
        found = resume.agree(where, lambda tree: resume.other_fit(tree, self._fit) or trees.mismatch(
            tree.get("state_dict"), pl_module.state_dict(), "state_dict"), replicas=replicated is not None) \
            if everywhere else None
        if found is not None:       # what fit(ckpt_path=...) would have read; a path given to fit replaces it
            self._restored, tree, lender = found
            self._mapped = restored.storages(tree)
            trainer._checkpoint_connector._loaded_checkpoint = _loadable(tree)
            if lender != resume.rank():
                resume.lent(self._restored, lender, "a replica's checkpoint, as one Lightning checkpoint file is "
                                                    "every rank's")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last = trainer.global_step
        self._loaded(trainer)

    def _loaded(self, trainer: pl.Trainer) -> None:
        """Once Lightning has restored (at the training's start, or at teardown for a fit with nothing left to
        train): the optimizers settled (restored.settle_optimizers), the resume said."""
        if self._restored is None or self._said:
            return
        self._said = True
        given = trainer._checkpoint_connector._ckpt_path
        if given:
            say(f"fit(ckpt_path={str(given)!r}) was loaded, not the snapshot of step {self._restored}")
            return           # Lightning read that file: nothing of the snapshot was loaded
        restored.settle_optimizers(trainer.optimizers, self._mapped)
        self._mapped = set()
        resume.resumed(self._restored)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The optimizers exist now: a state a snapshot cannot hold is an error before the first step, and the
        restored optimizers' state goes onto their parameters' GPUs through pinned buffers (upload.py) before
        Lightning loads it."""
        if self._capture is not None:
            trees.refuse_unplain(self._checkpoint(trainer), "Snapshots: the Lightning checkpoint's ")
        loaded = trainer._checkpoint_connector._loaded_checkpoint
        states = loaded.get("optimizer_states") if self._restored is not None and isinstance(loaded, dict) else None
        if isinstance(states, list) and len(states) == len(trainer.optimizers) and _whole_states(trainer) \
                and not trainer._checkpoint_connector._ckpt_path:
            ring = upload.Ring()          # one for all the optimizers
            try:
                loaded["optimizer_states"] = [upload.optimizer_state_onto(state, optimizer, ring)
                                              for state, optimizer in zip(states, trainer.optimizers, strict=True)]
            finally:
                ring.close()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._capture is not None:
            self._capture.before_update()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        # Due once the step passed a multiple of `every`, not only landed on one: global_step moves once per
        # optimizer step, 2 a batch with two optimizers (a GAN), and steps 1, 3, 5, ... never land on 4's
        if self._capture is not None and step // self.every > self._last // self.every:
            self._last = step
            # Dumped now, as a ModelCheckpoint(every_n_train_steps) dumps it; taken by _take_due once the checkpoint
            # callbacks (Lightning runs them last) have saved: a crash in their save resumes from the snapshot before
            # and saves this step again, as Lightning's own resume does (taken at once, it left the file torn)
            self._due = (step, {**self._checkpoint(trainer), resume.FIT: self._fit})
        elif self._capture is not None and not self._prepared and any(o.state for o in trainer.optimizers):
            self._prepared = True
            if pl_module.device.type == "cuda":    # the first snapshot's buffers, ahead: the checkpoint's GPU
                # tensors as they lie in it (its dump would call the user's on_save_checkpoint hooks once more)
                self._capture.prepare({"state_dict": pl_module.state_dict(),
                                       "optimizer_states": [o.state_dict() for o in trainer.optimizers]},
                                      trainer.optimizers)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._take_due(trainer)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._take_due(trainer)      # a crash in the validation resumes from this step, as before

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._take_due(trainer)      # before the epoch's LR schedulers step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._take_due(trainer)      # not in teardown: it runs after a crash in the save too

    def _take_due(self, trainer: pl.Trainer) -> None:
        due, self._due = self._due, None
        if due is not None and self._capture is not None:
            self._capture.take(due[0], due[1], trainer.optimizers)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._loaded(trainer)       # a fit with nothing left to train has no on_train_start
        if self._capture is not None:
            self._capture.wait()

    @staticmethod
    def _checkpoint(trainer: pl.Trainer) -> dict[str, Any]:
        checkpoint: dict[str, Any] = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        # the callbacks' states as they are now: a ModelCheckpoint's save changes its dicts in place before the take
        return {k: copy.deepcopy(v) if k == "callbacks" else v for k, v in checkpoint.items() if k not in NOT_KEPT}


def _loadable(tree: dict[str, Any]) -> dict[str, Any]:
    """The snapshot as Lightning loads it: copies of every tensor it may keep by reference (restored.owned), but the
    weights (copied into the module's) and the optimizers' state (large, and copied to their device: settled once
    loaded)."""
    def part(key: str, value: Any) -> Any:
        if key == "state_dict" and isinstance(value, dict):
            return restored.weights(value)
        return value if key == "optimizer_states" else restored.owned(value)
    return {k: part(k, v) for k, v in tree.items() if k != resume.FIT}


def _whole_states(trainer: pl.Trainer) -> bool:
    """Whether each rank loads its optimizers' state as it lies in the checkpoint (one device, DDP), not through a
    sharding strategy's own conversion (FSDP's, DeepSpeed's): only then does it go to the GPU beforehand."""
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy
    return isinstance(trainer.strategy, DDPStrategy | SingleDeviceStrategy) \
        and not isinstance(trainer.strategy, DeepSpeedStrategy)


def _replicated(trainer: pl.Trainer, pl_module: pl.LightningModule) -> Callable[[str], bool] | None:
    """Under the DDP strategy every rank holds the module's parameters alike: their digests go to the server,
    which compares the replicas (rdzv_server/core/divergence.py). Other strategies (DeepSpeed's too, a DDPStrategy
    whose ZeRO shards the optimizer or the parameters): none is compared, nor lent."""
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
    if not isinstance(trainer.strategy, DDPStrategy) or isinstance(trainer.strategy, DeepSpeedStrategy):
        return None
    names = {f"/state_dict/{name}" for name, _ in pl_module.named_parameters()}
    return names.__contains__
