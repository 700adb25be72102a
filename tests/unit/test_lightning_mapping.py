"""Lightning's restore from a snapshot keeps no part of the snapshot's file mapped (restored.settle_optimizers and
restored.owned): its loads keep CPU tensors by reference (the optimizers', an LR scheduler's), which would hold the
file's /dev/shm pages for the worker's life. And an ordinary Lightning resume is left alone."""
from __future__ import annotations

import os

import pytest
import torch

from node_agent.training import resume, snapshot


@pytest.fixture
def lm():
    """tests/unit/lightning_models.py: Lightning is imported as a test here runs, not as pytest collects it."""
    from tests.unit import lightning_models
    return lightning_models


def private_maps(name: str) -> list[str]:
    """The private mappings of the file (the restore's; the first fit's capture maps it shared)."""
    with open("/proc/self/maps") as f:
        return [line for line in f if name in line and line.split()[1].endswith("p")]


@pytest.mark.parametrize("steps, optimizer", [(6, "adamw"), (4, "adamw"), (6, "counted")],
                         ids=["steps-left", "nothing-left-to-train", "a-state-key-of-its-own"])
def test_a_lightning_restore_keeps_no_part_of_its_snapshot_file_mapped(lm, memory, capsys, steps, optimizer) -> None:
    lm.fit(4, optimizer)
    second = lm.fit(steps, optimizer)             # resumes at step 4
    assert "resumed from step 4 (memory)" in capsys.readouterr().out
    assert private_maps(os.path.realpath(snapshot.path(4, memory))) == []
    assert second.global_step == steps
    if optimizer == "counted":
        assert int(second.optimizers[0].state["t"]) == steps


def test_an_ordinary_lightning_resume_is_left_alone(lm, tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(snapshot.DIR_VAR, raising=False)       # as under torchrun: no memory directory
    first = lm.fit(2, "sparse")
    first.save_checkpoint(tmp_path / "c.ckpt")
    second = lm.fit(4, "sparse", ckpt=str(tmp_path / "c.ckpt"))
    assert second.global_step == 4 and second.optimizers[0].state[second.model.net.weight]["acc"].is_sparse


def test_a_lightning_restore_hands_the_optimizers_state_to_the_gpu_copy(lm, memory, monkeypatch) -> None:
    """At fit start the restored optimizers' state goes through upload.optimizer_state_onto (on a GPU: onto the
    parameters' device through pinned buffers), once per optimizer, before Lightning loads it."""
    from node_agent.training import upload
    real = upload.optimizer_state_onto
    seen: list[type] = []

    def onto(saved, optimizer, ring=None):
        seen.append(type(optimizer))
        return real(saved, optimizer, ring)

    monkeypatch.setattr(upload, "optimizer_state_onto", onto)
    lm.fit(4)
    assert seen == []                          # nothing restored
    second = lm.fit(6)
    assert seen == [torch.optim.AdamW] and second.global_step == 6
    assert upload.optimizer_state_onto({"state": {}, "param_groups": [{"params": [0, 1, 2]}]},
                                       second.optimizers[0]) == {"state": {}, "param_groups": [{"params": [0, 1, 2]}]}


def test_two_snapshots_callbacks_are_refused_in_one_line(lm, memory) -> None:
    """Two would each write the same steps' files in one memory directory and each hand a resume to Lightning."""
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 16)), batch_size=8)
    trainer = lm.L.Trainer(accelerator="cpu", devices=1, max_steps=2,
                           callbacks=[lm.Snapshots(every=2), lm.Snapshots(every=3)], logger=False,
                           enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match="2 Snapshots callbacks; keep one"):
        trainer.fit(lm.Tiny(), data)


def test_a_second_fit_in_one_process_does_not_resume_from_the_firsts_snapshots(lm, memory, capsys) -> None:
    """The same Trainer fit again (or a second phase's): it trains on from where it is, not from the first fit's
    snapshot of step 4 (a silent rewind, with no crash at all)."""
    trainer = lm.fit(6)
    trainer.fit_loop.epoch_loop.max_steps = 8
    trainer.fit(trainer.lightning_module, torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(64, 16)), batch_size=8))
    said = capsys.readouterr()
    assert "resumed from step" not in said.out and "this is its fit number 2" in said.err, said.err
    assert trainer.global_step == 8


def test_a_crash_in_modelcheckpoints_save_resumes_from_the_snapshot_before_it(lm, memory, tmp_path, capsys) -> None:
    """Snapshots took step 4 before ModelCheckpoint's save of it (Lightning runs checkpoint callbacks last): a crash
    in that save resumed from 4 and step 4's file was never written again (left torn). Taken after the save, the
    resume is from 2, as Lightning's own, and step 4 is saved again, whole."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Torn(ModelCheckpoint):
        def _save_checkpoint(self, trainer, filepath) -> None:
            if self.crash and trainer.global_step == 4:
                open(filepath, "w").close()
                raise RuntimeError("crashed in the save")
            super()._save_checkpoint(trainer, filepath)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 16)), batch_size=8)
    for crash in (True, False):
        resume._fits[0] = 0          # as a new process's first fit
        saves = Torn(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
        saves.crash = crash
        snaps = lm.Snapshots(every=2)
        trainer = lm.L.Trainer(accelerator="cpu", devices=1, max_steps=6, callbacks=[snaps, saves],
                               logger=False, enable_progress_bar=False, enable_model_summary=False)
        if crash:
            with pytest.raises(RuntimeError, match="crashed in the save"):
                trainer.fit(lm.Tiny(), data)
            # Lightning calls no callback's teardown after a crash: step 2's write may still run (a crashed
            # process's exit lets it end; here the next fit would race it, as one loaded run of the suite did)
            assert snaps._capture is not None
            snaps._capture.wait()
        else:
            trainer.fit(lm.Tiny(), data)
    assert "resumed from step 2 (memory)" in capsys.readouterr().out
    assert torch.load(tmp_path / "step=4-v1.ckpt", weights_only=False)["global_step"] == 4


def test_a_snapshot_is_due_once_global_step_passes_a_multiple_of_every(lm, memory, capsys) -> None:
    """Steps 1, 3, 5, ... never land on a multiple of 4: a snapshot taken only on one was never taken, and a crash
    went back to step 0. One is due at the first batch whose global step passed a multiple: 5 and 9 of 1..11."""
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(80, 4)), batch_size=8)
    for steps in (11, 13):
        resume._fits[0] = 0          # as a new process's first fit
        trainer = lm.L.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=[lm.Snapshots(every=4)],
                               logger=False, enable_checkpointing=False, enable_progress_bar=False,
                               enable_model_summary=False)
        trainer.fit(lm.Gan(), data)
        if steps == 11:
            assert sorted(os.listdir(memory)) == ["step-5", "step-9"]
    assert "resumed from step 9 (memory)" in capsys.readouterr().out
    assert trainer.global_step == 13
