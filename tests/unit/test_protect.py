"""protect(model, optimizer, every=N) in one process (no process group: its MIN is the rank's own value): what it
restores, what it refuses and how it says so, and that bad input stops it at the call."""
from __future__ import annotations

import os
import random

import pytest
import torch
from torch import nn

from node_agent.training import protect, snapshot
from node_agent.training.capture import Capture
from node_agent.training.resume import read


def job(width: int = 4) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.StepLR]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def train(model: nn.Module, opt: torch.optim.Optimizer, sched, start: int, stop: int, evaluate: bool = False) -> None:
    """`evaluate`: a forward under no_grad between the optimizer's step and the scheduler's (as
    `scheduler.step(val_loss)` needs)."""
    for step in range(start, stop):
        x = torch.randn(3, model[0].in_features, generator=torch.Generator().manual_seed(step))
        model(x).pow(2).mean().backward()
        opt.step()
        if evaluate:
            model.eval()
            with torch.no_grad():
                model(torch.ones(2, model[0].in_features))
            model.train()
        sched.step()
        opt.zero_grad()


def settle(model: nn.Module) -> None:
    """A forward with no step: a snapshot due is taken as the next step begins (here, this forward)."""
    model(torch.zeros(1, model[0].in_features))


def wait_for_writes() -> None:
    """The snapshot writes run in threads named after their step: join them (the test's synchronisation)."""
    import threading
    for t in threading.enumerate():
        if t.name.startswith("node-agent snapshot"):
            t.join(30)


def test_a_restart_resumes_model_optimizer_extras_and_rng_as_if_never_stopped(memory, capsys) -> None:
    model, opt, sched = job()
    assert protect(model, opt, every=3, extra={"sched": sched}) == 0
    train(model, opt, sched, 0, 6)
    settle(model)                                     # the snapshot of step 6 is taken here
    wait_for_writes()
    assert snapshot.steps(memory) == [3, 6]
    drawn = (torch.rand(3), random.random())          # what the step after 6 would draw
    train(model, opt, sched, 6, 8)                    # 8 steps, then the "crash" (the next snapshot is at 9)
    reference = {k: v.clone() for k, v in model.state_dict().items()}

    model2, opt2, sched2 = job()
    torch.manual_seed(123)                             # a fresh process: other RNG states
    random.seed(123)
    start = protect(model2, opt2, every=3, extra={"sched": sched2})
    assert start == 6
    assert "resumed from step 6 (memory)" in capsys.readouterr().out
    assert sched2.last_epoch == 6 and opt2.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5 ** 3)
    assert torch.equal(torch.rand(3), drawn[0]) and random.random() == drawn[1]
    torch.manual_seed(0)
    random.seed(0)
    train(model2, opt2, sched2, start, 8)
    assert all(torch.equal(v, reference[k]) for k, v in model2.state_dict().items())


def drawing(model: nn.Module, opt: torch.optim.Optimizer, sched, batches: torch.Generator, start: int,
            stop: int) -> None:
    """A loop that draws each step's batch before its forward, from a generator of its own and the global RNG
    (noise, as data augmentation would), between the last step's optimizer.step() and this step's forward."""
    for _ in range(start, stop):
        x = torch.randn(3, model[0].in_features, generator=batches) + 0.1 * torch.randn(3, model[0].in_features)
        model(x).pow(2).mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()


def test_a_loop_that_draws_its_batch_before_the_forward_resumes_on_the_same_batches(memory) -> None:
    """The RNG states kept are those the next step starts from (as the optimizer step left them), not those of
    the next forward, by which time the loop drew its batch: a resumed run trains on the batches an uninterrupted
    one does, so its weights are the same, bit for bit. A torch.Generator in `extra` is kept the same way."""
    torch.manual_seed(7)
    model, opt, sched = job()
    batches = torch.Generator().manual_seed(11)
    torch.manual_seed(7)
    assert protect(model, opt, every=3, extra={"sched": sched, "batches": batches}) == 0
    drawing(model, opt, sched, batches, 0, 8)          # snapshots of 3 and 6, taken at the forwards of 4 and 7
    wait_for_writes()
    reference = {k: v.clone() for k, v in model.state_dict().items()}

    model2, opt2, sched2 = job()
    batches2 = torch.Generator().manual_seed(999)      # a fresh process: other states
    torch.manual_seed(123)
    start = protect(model2, opt2, every=3, extra={"sched": sched2, "batches": batches2})
    assert start == 6
    drawing(model2, opt2, sched2, batches2, start, 8)
    assert all(torch.equal(v, reference[k]) for k, v in model2.state_dict().items()), "another batch was drawn"


class Calls(nn.Module):
    """Counts its forwards in a buffer, in any mode (as a module keeping a running step does)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x


def frozen_norm(model: nn.Module, opt: torch.optim.Optimizer, start: int, stop: int) -> None:
    """Fine-tuning in eval mode (frozen batch norm), its batches drawn from the global RNG before each forward."""
    model.eval()
    for _ in range(start, stop):
        model(torch.randn(3, model[0].in_features)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def test_a_model_trained_in_eval_mode_is_snapshotted_as_its_next_step_begins(memory) -> None:
    """Eval mode is no evaluation: with grad enabled, the next forward takes the snapshot, before it runs; taken
    later (at the optimizer's step), it would hold that forward's work, and the resumed run would do it twice."""
    def frozen() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2), Calls())
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    model, opt = frozen()
    protect(model, opt, every=3)
    frozen_norm(model, opt, 0, 8)
    wait_for_writes()
    reference = {k: v.clone() for k, v in model.state_dict().items()}

    model2, opt2 = frozen()
    torch.manual_seed(123)                  # the RNG state the snapshot holds must replace this one
    assert protect(model2, opt2, every=3) == 6
    frozen_norm(model2, opt2, 6, 8)
    assert int(model2[3].calls) == 8
    assert all(torch.equal(v, reference[k]) for k, v in model2.state_dict().items())


def test_an_evaluation_before_the_scheduler_steps_is_not_where_the_snapshot_is_taken(memory) -> None:
    """The snapshot is taken at the next training forward, not at an evaluation's (no grad, eval mode): taken there,
    it would hold the scheduler one step behind, and the resumed run would train on another learning rate."""
    model, opt, sched = job()
    protect(model, opt, every=3, extra={"sched": sched})
    train(model, opt, sched, 0, 8, evaluate=True)     # snapshots of 3 and 6, taken at the forwards of 4 and 7
    wait_for_writes()
    reference = {k: v.clone() for k, v in model.state_dict().items()}

    model2, opt2, sched2 = job()
    assert protect(model2, opt2, every=3, extra={"sched": sched2}) == 6
    assert sched2.last_epoch == 6
    train(model2, opt2, sched2, 6, 8, evaluate=True)
    assert all(torch.equal(v, reference[k]) for k, v in model2.state_dict().items())


def test_a_ddp_model_and_its_inner_module_share_snapshots(memory) -> None:
    model, opt, sched = job()
    protect(model, opt, every=2)
    train(model, opt, sched, 0, 2)
    settle(model)
    wait_for_writes()
    tree = read(2, memory)
    assert not isinstance(tree, str) and set(tree["state"]["model"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_a_damaged_snapshot_is_refused_with_one_line_and_the_older_one_loaded(memory, capsys) -> None:
    model, opt, sched = job()
    protect(model, opt, every=2)
    train(model, opt, sched, 0, 2)
    settle(model)
    wait_for_writes()
    at_two = {k: v.clone() for k, v in model.state_dict().items()}
    train(model, opt, sched, 2, 4)
    settle(model)
    wait_for_writes()
    newest = snapshot.path(4, memory)
    data = bytearray(open(newest, "rb").read())
    weight = model[0].weight.detach().numpy().tobytes()
    at = bytes(data).find(weight)
    assert at > 0
    data[at + 5] ^= 0xFF                               # one flipped bit pattern inside a weight
    open(newest, "wb").write(bytes(data))

    model2, opt2, _ = job()
    assert protect(model2, opt2, every=2) == 2
    err = capsys.readouterr().err
    assert "step-4" in err and "tensor /state/model/0.weight fails its checksum" in err
    assert all(torch.equal(v, at_two[k]) for k, v in model2.state_dict().items())
    assert snapshot.steps(memory) == [2]                # the refused step is gone with the future it held


def test_a_snapshot_of_another_model_is_refused_and_nothing_is_loaded(memory, capsys) -> None:
    model, opt, sched = job(width=4)
    protect(model, opt, every=1)
    train(model, opt, sched, 0, 1)
    settle(model)
    wait_for_writes()
    other, other_opt, _ = job(width=5)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    assert protect(other, other_opt, every=1, fallback=lambda: 17) == 17     # the script's own checkpoint, or 0
    err = capsys.readouterr().err
    assert "model/0.weight is torch.float32 [8, 4] in the snapshot, torch.float32 [8, 5] in the model" in err
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())
    assert not other_opt.state                         # the optimizer untouched too: no partial load


def test_an_optimizer_over_other_parameters_is_refused(memory, capsys) -> None:
    model, opt, sched = job()
    protect(model, opt, every=1)
    train(model, opt, sched, 0, 1)
    settle(model)
    wait_for_writes()
    model2, _, _ = job()
    partial = torch.optim.AdamW(model2[0].parameters())
    assert protect(model2, partial, every=1) == 0
    assert "optim has [4] parameters per group in the snapshot, [2] in the optimizer" in capsys.readouterr().err


def test_outside_node_agent_it_takes_nothing_says_so_once_and_returns_the_fallback(monkeypatch, capsys) -> None:
    monkeypatch.delenv(snapshot.DIR_VAR, raising=False)
    monkeypatch.delenv("RANK", raising=False)
    model, opt, _ = job()
    assert protect(model, opt, every=2) == 0
    assert protect(model, opt, every=2, fallback=lambda: 40) == 40
    assert capsys.readouterr().err.count("no snapshots are taken") == 2     # once per call: once per script
    assert not opt._optimizer_step_post_hooks                                 # no hook: nothing else runs


class NotStateful:
    pass


class OddState:
    def state_dict(self) -> dict[str, object]:
        return {"when": object()}

    def load_state_dict(self, state: object) -> None:
        pass


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda m, o: protect("model", o), TypeError, "a builtins.str is not a torch.nn.Module"),
    (lambda m, o: protect(m, m), TypeError, "a torch.nn.modules.container.Sequential is not a torch.optim.Optimizer"),
    (lambda m, o: protect(m, o, every=0), ValueError, "protect\\(every=...\\): 0 is not a whole number"),
    (lambda m, o: protect(m, o, every=True), ValueError, "True is not a whole number"),
    (lambda m, o: protect(m, o, every=2.5), ValueError, "2.5 is not a whole number"),
    (lambda m, o: protect(m, o, keep=0), ValueError, "protect\\(keep=...\\)"),
    (lambda m, o: protect(m, o, extra={"data": NotStateful()}), TypeError,
     "extra=\\{'data': ...\\}\\): a .*NotStateful has no state_dict/load_state_dict"),
    (lambda m, o: protect(m, o, extra={"odd": OddState()}), TypeError,
     "/extra/odd/when is a builtins.object: a snapshot holds tensors and plain values"),
])
def test_bad_input_is_an_error_at_the_call_naming_the_object(memory, call, error, message) -> None:
    model, opt, _ = job()
    with pytest.raises(error, match=message):
        call(model, opt)
    assert not opt._optimizer_step_post_hooks and os.listdir(memory) == []


def test_a_snapshot_that_does_not_fit_is_said_once_and_training_goes_on(memory, monkeypatch, capsys) -> None:
    monkeypatch.setenv(snapshot.LIMIT_VAR, "200")
    model, opt, sched = job()
    protect(model, opt, every=1)
    train(model, opt, sched, 0, 3)
    settle(model)
    wait_for_writes()
    assert snapshot.steps(memory) == []
    assert capsys.readouterr().err.count("does not fit the memory directory") == 1


def test_the_copy_is_taken_when_take_returns(memory) -> None:
    """The training may change its tensors as soon as `take` returns: the file holds the values at `take`."""
    capture = Capture(memory)
    weights = torch.ones(1000)
    capture.take(1, {"w": weights})
    weights.add_(1)
    capture.wait()
    tree = read(1, memory)
    assert not isinstance(tree, str) and torch.equal(tree["w"], torch.ones(1000))
    assert snapshot.steps(memory) == [1]


ACCELERATE_LOOP = """
import threading, torch
from accelerate import Accelerator
from node_agent.training import protect
accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
model, opt = accelerator.prepare(torch.nn.Linear(4, 2), torch.optim.AdamW(torch.nn.Linear(4, 2).parameters()))
start = protect(model, opt, every=2)
for step in range(start, 4):
    accelerator.backward(model(torch.ones(3, 4) * step).sum())
    opt.step()
    opt.zero_grad()
model(torch.zeros(1, 4))
[t.join() for t in threading.enumerate() if t.name.startswith("node-agent snapshot")]
print("START", start, "WEIGHT", model.weight.sum().item())
"""


def test_a_loop_on_accelerate_is_protected_through_the_optimizer_it_wraps(memory) -> None:
    """accelerate's AcceleratedOptimizer has no step hooks of its own: protect hooks the torch optimizer inside.
    (In a process of its own: an Accelerator is process-wide state.)"""
    import subprocess
    import sys
    run = [sys.executable, "-c", ACCELERATE_LOOP]
    first = subprocess.run(run, capture_output=True, text=True, timeout=120, env={**os.environ})
    assert first.returncode == 0, first.stderr
    assert snapshot.steps(memory) == [2, 4], first.stdout
    second = subprocess.run(run, capture_output=True, text=True, timeout=120, env={**os.environ})
    assert second.returncode == 0, second.stderr
    assert "resumed from step 4 (memory)" in second.stdout and "START 4" in second.stdout
    assert second.stdout.split("WEIGHT")[1] == first.stdout.split("WEIGHT")[1]    # nothing left to train: the same


FSDP_ROOT_ONLY = """
import os, threading, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from node_agent.training import protect
dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", 0, 1, True), rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
fully_shard(model)                  # the root only: its forward's own hook unshards every parameter
opt = torch.optim.SGD(model.parameters(), lr=0.1)
start = protect(model, opt, every=1)
for _ in range(3):
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
[t.join() for t in threading.enumerate() if t.name.startswith("node-agent snapshot")]
print("START", start)
dist.destroy_process_group()
"""


def test_a_model_sharded_at_its_root_only_trains_on_past_its_snapshots(memory) -> None:
    """FSDP2's forward hook unshards the parameters; a snapshot's state_dict taken after it put the sharded ones
    back under the forward's feet (mixed Tensor and DTensor): protect's hook runs first. (In a process of its own:
    a process group is process-wide state.)"""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", FSDP_ROOT_ONLY], capture_output=True, text=True, timeout=120,
                          env={**os.environ})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "START 0" in done.stdout and snapshot.steps(memory) == [1, 2]      # taken as the next step began


def test_the_step_a_job_starts_from_without_a_snapshot_goes_to_the_probe(memory, monkeypatch) -> None:
    """The server counts the steps a restart trains again (and says so: work_redone) from the step each worker
    resumed from: a job sent back to its disk checkpoint or to the start tells that step too."""
    import sys
    import types

    from node_agent.training.heartbeat import PROBE_MODULE
    told: list[int] = []
    monkeypatch.setitem(sys.modules, PROBE_MODULE, types.SimpleNamespace(
        resumed=told.append, beat=lambda: None, mark=lambda _: None))
    model, opt, _ = job()
    assert protect(model, opt, every=2, fallback=lambda: 17) == 17 and told == [17]
    other, other_opt, _ = job()
    assert protect(other, other_opt, every=2) == 0 and told == [17, 0]
