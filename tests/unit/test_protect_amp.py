"""protect under a GradScaler (AMP): a step the scaler skips (an inf in the gradients) is the loop's step all the
same, so the count protect returns is the loop's, and a resumed loop starts on the batch it was at."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from node_agent.training import protect, snapshot
from tests.unit.test_protect import settle, wait_for_writes

SKIPPED = (1, 4)        # the loop's steps whose gradients overflow (fp16's first steps, at the default scale)


def job(fused: bool) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.StepLR, torch.amp.GradScaler]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=fused)
    return (model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
            torch.amp.GradScaler("cpu", init_scale=4.0))


def scaled(model: nn.Module, opt: torch.optim.Optimizer, sched, scaler: torch.amp.GradScaler, start: int,
           stop: int) -> None:
    """The AMP loop: each step's batch by its number; SKIPPED steps overflow, and the scaler skips the update."""
    for step in range(start, stop):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        scaler.scale(model(x).pow(2).mean()).backward()
        if step in SKIPPED:
            model[0].weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad()


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step()` before `optimizer.step()`")
@pytest.mark.parametrize("fused", [False, True])
def test_a_step_the_scaler_skips_counts_and_the_loop_resumes_on_its_batch(memory, fused) -> None:
    """6 steps, 2 of them skipped: the snapshots are of the loop's steps 3 and 6 (the optimizer's step hook alone
    saw 4 updates: it resumed at 3, and the resumed loop trained step 3 again, and other weights). A fused optimizer
    steps even when the scaler skips (it skips inside): counted once."""
    model, opt, sched, scaler = job(fused)
    assert protect(model, opt, every=3, extra={"sched": sched, "scaler": scaler}) == 0
    scaled(model, opt, sched, scaler, 0, 6)
    settle(model)
    wait_for_writes()
    assert snapshot.steps(memory) == [3, 6]
    scaled(model, opt, sched, scaler, 6, 8)
    reference = {k: v.clone() for k, v in model.state_dict().items()}

    model2, opt2, sched2, scaler2 = job(fused)
    start = protect(model2, opt2, every=3, extra={"sched": sched2, "scaler": scaler2})
    assert start == 6 and scaler2.get_scale() == scaler.get_scale()
    scaled(model2, opt2, sched2, scaler2, start, 8)
    assert all(torch.equal(v, reference[k]) for k, v in model2.state_dict().items()), "another batch was trained on"


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step()` before `optimizer.step()`")
def test_a_protected_scaler_pickles_and_copies_as_a_scaler_of_its_own(memory) -> None:
    """Its counting step was a closure in the scaler's __dict__: torch.save(scaler) failed ("Can't pickle local
    object"), and a deepcopy's step was the original's (it stepped, and backed off, the original scaler)."""
    import copy
    import io

    model, opt, sched, scaler = job(False)
    protect(model, opt, every=3, extra={"sched": sched, "scaler": scaler})
    scaled(model, opt, sched, scaler, 0, 2)
    out = io.BytesIO()
    torch.save(scaler, out)
    out.seek(0)
    loaded = torch.load(out, weights_only=False)
    assert loaded.get_scale() == scaler.get_scale() == 2.0
    twin = copy.deepcopy(scaler)
    scaled(model, opt, sched, twin, 4, 5)         # step 4 overflows: the copy backs off, the original does not
    assert twin.get_scale() == 1.0 and scaler.get_scale() == 2.0
