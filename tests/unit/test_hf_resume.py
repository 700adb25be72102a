"""protect_trainer's resume in one process (no process group): a Trainer stopped after its snapshot of step 5
resumes from it and ends with the weights of a run never stopped, bit for bit (the Trainer's own resume restores
the RNG states, and GPT-2's dropout draws from them), with an evaluation at the snapshot's step too: it draws from
the RNG (its DataLoader's seed), so the snapshot holds the RNG states from after it, as the Trainer's own
checkpoint does (before, from before it: the resumed run's next dropout masks were not the uninterrupted run's)."""
from __future__ import annotations

import pytest
import torch

from node_agent.training import resume, snapshot

# transformers (and node_agent.training.hf, which imports it) are imported by each test, not as pytest collects this
# module: ~3 s of CPU in every xdist worker of `make test`, which collects every module but runs these four tests in
# one or two of them.


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train(out, evaluate: str, stop: bool = False) -> dict[str, torch.Tensor]:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from node_agent.training.hf import protect_trainer

    class Stop(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs) -> None:
            if state.global_step == 7:
                raise RuntimeError("stopped at step 7")

    resume._fits[0] = 0          # as a new process's first train()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    args = TrainingArguments(output_dir=str(out), max_steps=9, per_device_train_batch_size=4, learning_rate=1e-3,
                             seed=0, use_cpu=True, save_strategy="no", report_to=[], disable_tqdm=True,
                             logging_steps=1000, eval_strategy=evaluate, eval_steps=5)
    # "epoch": 5 steps an epoch, the snapshot's step the first epoch's last
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(20 if evaluate == "epoch" else 96),
                      eval_dataset=Tokens(8),
                      callbacks=[Stop()] if stop else [])
    snapshots = protect_trainer(trainer, every=5)
    if stop:
        with pytest.raises(RuntimeError, match="stopped at step 7"):
            trainer.train()
        snapshots._capture.wait()
    else:
        trainer.train()
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.parametrize("evaluate", ["no", "steps", "epoch"])
def test_a_resumed_trainer_ends_as_one_never_stopped(memory, tmp_path, monkeypatch, capsys, evaluate) -> None:
    with monkeypatch.context() as outside:
        outside.delenv(snapshot.DIR_VAR)          # not under node-agent: no snapshots
        whole = train(tmp_path / "whole", evaluate)
    train(tmp_path / "stopped", evaluate, stop=True)
    resumed = train(tmp_path / "resumed", evaluate)
    assert "resumed from step 5 (memory)" in capsys.readouterr().out
    assert whole.keys() == resumed.keys()
    assert [k for k in whole if not torch.equal(whole[k], resumed[k])] == []


@pytest.mark.parametrize("keep", [1, 2])
def test_a_trainer_restarted_after_its_last_step_trains_no_step_past_max_steps(memory, tmp_path, capsys,
                                                                              keep) -> None:
    """No snapshot is taken of step max_steps (the training's end): the Trainer's resume runs one more step from
    it (global_step 11 of 10, a batch and an LR step past the run), so a worker that failed after train() returned
    ended past an uninterrupted run. It resumes from the one before, and the steps are done again as they were."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from node_agent.training.hf import protect_trainer

    def run(out) -> tuple[int, dict[str, torch.Tensor]]:
        resume._fits[0] = 0          # as a new process's first train()
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
        args = TrainingArguments(output_dir=str(out), max_steps=10, per_device_train_batch_size=4,
                                 learning_rate=1e-3, lr_scheduler_type="constant", seed=0, use_cpu=True,
                                 save_strategy="no", report_to=[], disable_tqdm=True, logging_steps=1000)
        trainer = Trainer(model=model, args=args, train_dataset=Tokens(96))
        protect_trainer(trainer, every=5, keep=keep)
        trainer.train()
        return trainer.state.global_step, {k: v.clone() for k, v in trainer.model.state_dict().items()}

    steps, whole = run(tmp_path / "whole")
    again, resumed = run(tmp_path / "again")      # the same memory: a worker restarted after train() returned
    said = capsys.readouterr()
    out = said.out + said.err
    assert (steps, again) == (10, 10)
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert "resumed from step 5 (memory)" in out, out


def test_protect_trainer_twice_is_refused_in_one_line(memory, tmp_path) -> None:
    """Twice, two captures raced for each step's file (one failed every snapshot) and two resumes were laid out."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from node_agent.training.hf import protect_trainer
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, use_cpu=True, report_to=[], save_strategy="no")
    trainer = Trainer(model=GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2,
                                                       n_head=2)), args=args, train_dataset=Tokens(8))
    protect_trainer(trainer, every=5)
    with pytest.raises(ValueError, match="protected already"):
        protect_trainer(trainer, every=5)


def test_a_second_train_in_one_process_does_not_resume_from_the_firsts_snapshots(memory, tmp_path, capsys) -> None:
    """A script's second Trainer (a second phase) found the first one's snapshot of step 5 and, with no crash,
    resumed from it: 5 of its 10 steps skipped. Each train() resumes from its own snapshots only."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from node_agent.training.hf import protect_trainer
    resume._fits[0] = 0
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    for _ in (1, 2):
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=10, per_device_train_batch_size=4, use_cpu=True,
                                 save_strategy="no", report_to=[], disable_tqdm=True, logging_steps=1000)
        trainer = Trainer(model=model, args=args, train_dataset=Tokens(40))
        protect_trainer(trainer, every=5)
        trainer.train()
    said = capsys.readouterr()
    assert "resumed from step" not in said.out + said.err
    assert "this is its fit number 2" in said.err, said.err
