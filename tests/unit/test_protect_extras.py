"""protect's `extra` objects on a resume: an object's plain state (a history that grows, a dict per epoch) is the
object's to load, whatever its keys and lengths; the extras' names and their tensors must still fit."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from node_agent.training import protect, snapshot
from tests.unit.test_protect import job, settle, train, wait_for_writes


class History:
    """A loop's own record, as a script keeps it: a list that grows each step and a dict keyed by the epoch."""

    def __init__(self, shape: tuple[int, ...] = (2,)) -> None:
        self.losses: list[float] = []
        self.by_epoch: dict[str, float] = {}
        self.ema = torch.zeros(shape)

    def add(self, step: int) -> None:
        self.losses.append(step / 10)
        self.by_epoch[str(step // 2)] = step / 10
        self.ema += step

    def state_dict(self) -> dict[str, Any]:
        return {"losses": list(self.losses), "by_epoch": dict(self.by_epoch), "ema": self.ema.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses, self.by_epoch, self.ema = list(state["losses"]), dict(state["by_epoch"]), state["ema"].clone()


def trained(memory: str, history: History) -> None:
    """4 steps with a snapshot every 2, the history in `extra`, one entry a step."""
    model, opt, sched = job()
    assert protect(model, opt, every=2, extra={"sched": sched, "history": history}) == 0
    for step in range(4):
        train(model, opt, sched, step, step + 1)
        history.add(step)
    settle(model)
    wait_for_writes()
    assert snapshot.steps(memory) == [2, 4]


def test_an_extras_plain_state_that_grew_is_resumed_not_refused(memory, capsys) -> None:
    """A fresh History holds no entries where the snapshot holds 4: refused (a list's length, a dict's keys), every
    resume went back to step 0."""
    trained(memory, History())
    model, opt, sched = job()
    again = History()
    assert protect(model, opt, every=2, extra={"sched": sched, "history": again}) == 4
    assert "refused" not in capsys.readouterr().err
    assert again.losses == [0.0, 0.1, 0.2, 0.3] and again.by_epoch == {"0": 0.1, "1": 0.3}
    assert torch.equal(again.ema, torch.full((2,), 6.0))


def test_an_extras_tensor_of_another_shape_and_another_extras_name_are_still_refused(memory, capsys) -> None:
    trained(memory, History())
    model, opt, sched = job()
    assert protect(model, opt, every=2, extra={"sched": sched, "history": History((3,))}) == 0
    assert "extra/history/ema is torch.float32 [2] in the snapshot, torch.float32 [3] in the model" in \
        capsys.readouterr().err
    trained(memory, History())
    model, opt, sched = job()
    assert protect(model, opt, every=2, extra={"sched": sched, "history": History(), "more": History()}) == 0
    assert "extra: keys 'more' missing from the snapshot" in capsys.readouterr().err


def test_a_scripts_second_protect_resumes_from_its_own_snapshots_only(script_calls, capsys) -> None:
    """Two phases in one script, each with its optimizer and protect: the second, with no crash at all, resumed
    from the first's snapshot (step 15 of 20) and skipped 15 of its steps; restarted, the first resumed from the
    second's. Now each refuses the other's (said once a step): a crash in the second phase sends both back to their
    start (the first's snapshots went as the second began), never into the other's steps."""
    model, opt, sched = job()
    assert protect(model, opt, every=5) == 0
    train(model, opt, sched, 0, 20)
    opt2 = torch.optim.SGD(model.parameters(), lr=0.01)
    assert protect(model, opt2, every=5) == 0
    assert "taken by the script's protect call number 1, and this is its protect call number 2" in \
        capsys.readouterr().err
    train(model, opt2, sched, 0, 7)
    settle(model)
    wait_for_writes()
    assert snapshot.steps(script_calls) == [25]           # numbered after the first's 20: no number taken twice

    restart()
    model, opt, sched = job()
    assert protect(model, opt, every=5) == 0
    assert "taken by the script's protect call number 2, and this is its protect call number 1" in \
        capsys.readouterr().err


def restart() -> None:
    """A new process of the script: its protect calls numbered from its first again."""
    from node_agent.training import protection
    protection._CALLS[0] = protection._NUMBERED[0] = 0
    protection._LIVE.clear()


def test_an_object_an_extra_gains_after_the_call_is_said_once_and_no_snapshot_is_written(memory, capsys) -> None:
    """A history that takes numpy floats is empty at the call (nothing to refuse there): each snapshot was written,
    then refused as unreadable on every resume (weights_only), and a crash went back to step 0 with nothing said
    while it trained."""
    import numpy as np

    history = History()
    model, opt, sched = job()
    protect(model, opt, every=2, extra={"history": history})
    for step in range(6):
        train(model, opt, sched, step, step + 1)
        history.losses.append(np.float32(step))
    settle(model)
    wait_for_writes()
    assert snapshot.steps(memory) == []
    err = capsys.readouterr().err
    assert err.count("no snapshot of step 2 (nor later, while it holds it): the state's /extra/history/losses/0 is "
                     "a numpy.float32: a snapshot holds tensors and plain values") == 1, err
    assert "step 4" not in err


def drawn(model, opt, sched, rngs, start: int, stop: int) -> None:
    """Each step's batch drawn before its forward from a numpy Generator and a random.Random of the loop's own."""
    for _ in range(start, stop):
        x = torch.tensor(rngs["np"].standard_normal((3, 4)), dtype=torch.float32) * rngs["py"].random()
        model(x).pow(2).mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()


def test_a_loops_numpy_and_python_generators_in_extra_resume_on_the_same_batches(memory) -> None:
    """As a torch.Generator in `extra`: their states as the optimizer step left them, not as the next forward found
    them (past the batch drawn for it). Refused at the call before; wrapped in a Stateful of the script's own, they
    were taken at the forward and the resumed run drew other batches."""
    import random

    import numpy as np

    def rngs(seed: int) -> dict:
        return {"np": np.random.default_rng(seed), "py": random.Random(seed)}

    model, opt, sched = job()
    mine = rngs(5)
    assert protect(model, opt, every=3, extra={"sched": sched, **mine}) == 0
    drawn(model, opt, sched, mine, 0, 8)              # snapshots of 3 and 6, taken at the forwards of 4 and 7
    wait_for_writes()
    reference = {k: v.clone() for k, v in model.state_dict().items()}

    model2, opt2, sched2 = job()
    again = rngs(99)                                  # a fresh process: other states
    assert protect(model2, opt2, every=3, extra={"sched": sched2, **again}) == 6
    drawn(model2, opt2, sched2, again, 6, 8)
    assert all(torch.equal(v, reference[k]) for k, v in model2.state_dict().items()), "another batch was drawn"


@pytest.mark.parametrize("kind", ["Philox", "MT19937", "SFC64", "RandomState"])
def test_a_numpy_generator_on_any_bit_generator_and_a_randomstate_resume_on_the_same_batches(memory, kind) -> None:
    """Their states hold arrays: refused at the call ("/extra/np/state/counter is a numpy.ndarray"), only
    default_rng's PCG64 was taken. One generator under two names is taken and loaded as each."""
    import random

    import numpy as np

    def rngs(seed: int) -> dict:
        made = np.random.RandomState(seed) if kind == "RandomState" else np.random.Generator(
            getattr(np.random, kind)(seed))
        return {"np": made, "same": made, "py": random.Random(seed)}

    model, opt, sched = job()
    mine = rngs(5)
    assert protect(model, opt, every=3, extra={"sched": sched, **mine}) == 0
    drawn(model, opt, sched, mine, 0, 8)
    wait_for_writes()
    reference = {k: v.clone() for k, v in model.state_dict().items()}

    model2, opt2, sched2 = job()
    again = rngs(99)
    assert protect(model2, opt2, every=3, extra={"sched": sched2, **again}) == 6
    drawn(model2, opt2, sched2, again, 6, 8)
    assert all(torch.equal(v, reference[k]) for k, v in model2.state_dict().items()), "another batch was drawn"


def test_system_random_in_extra_is_refused_in_one_line_at_the_call(memory) -> None:
    """It is a random.Random, but the OS's: getstate raised NotImplementedError inside protect."""
    import random

    model, opt, _ = job()
    with pytest.raises(TypeError, match="a random.SystemRandom has no state_dict"):
        protect(model, opt, extra={"r": random.SystemRandom()})


def test_a_numpy_float64_in_an_extras_state_is_kept_as_a_float(memory, capsys) -> None:
    """numpy's float64 is a float (so the plain check let it pass), but pickled as numpy's scalar: every snapshot
    of a history of np.mean's values was refused as unreadable on the resume (weights_only), back to step 0."""
    import numpy as np

    history = History()
    model, opt, sched = job()
    protect(model, opt, every=2, extra={"history": history})
    for step in range(4):
        train(model, opt, sched, step, step + 1)
        history.losses.append(np.float64(step) / 4)
    settle(model)
    wait_for_writes()
    model, opt, sched = job()
    again = History()
    assert protect(model, opt, every=2, extra={"history": again}) == 4
    assert "refused" not in capsys.readouterr().err
    assert again.losses == [0.0, 0.25, 0.5, 0.75] and all(type(v) is float for v in again.losses)


def test_a_fresh_objects_empty_list_or_dict_takes_the_snapshots_tensors(memory, capsys) -> None:
    """A history of loss tensors (`losses.append(loss.detach())`) and a second optimizer (a GAN's) are empty in a
    fresh object: their tensors had nothing to fit, every snapshot was refused ("extra/history/losses: 4 entries
    in the snapshot, 0 entries in the model") and every resume went back to step 0."""
    def setup() -> tuple[Any, ...]:
        model, opt, sched = job()
        other = torch.nn.Linear(2, 2)
        return model, opt, sched, History(), other, torch.optim.Adam(other.parameters())

    model, opt, sched, history, other, opt2 = setup()
    protect(model, opt, every=2, extra={"history": history, "opt2": opt2})
    for step in range(4):
        train(model, opt, sched, step, step + 1)
        history.losses.append(torch.full((3,), float(step)))   # type: ignore[arg-type]
        other(torch.ones(1, 2)).sum().backward()
        opt2.step()
    settle(model)
    wait_for_writes()
    model, opt, sched, again, other, opt2_again = setup()
    assert protect(model, opt, every=2, extra={"history": again, "opt2": opt2_again}) == 4
    assert "refused" not in capsys.readouterr().err
    assert [v.tolist() for v in again.losses] == [[float(s)] * 3 for s in range(4)]   # type: ignore[attr-defined]
    assert torch.equal(opt2_again.state_dict()["state"][0]["exp_avg"], opt2.state_dict()["state"][0]["exp_avg"])


def test_an_objects_list_that_was_not_empty_still_fits_by_its_length(memory, capsys) -> None:
    history = History()
    history.losses = [torch.zeros(2)]     # type: ignore[list-item]
    trained(memory, history)
    model, opt, sched = job()
    again = History()
    again.losses = [torch.zeros(2), torch.zeros(2)]     # type: ignore[list-item]
    assert protect(model, opt, every=2, extra={"sched": sched, "history": again}) == 0
    assert "extra/history/losses: 5 entries in the snapshot, 2 entries in the model" in capsys.readouterr().err


class Window(History):
    """A record whose load takes at most `most` losses (a fixed window): the snapshot's grown history reaches it."""

    def __init__(self, most: int) -> None:
        super().__init__()
        self.most = most

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["losses"]) > self.most:
            raise ValueError(f"a window holds at most {self.most} entries,\nnot {len(state['losses'])}")
        super().load_state_dict(state)


def test_an_extra_whose_load_fails_refuses_the_step_in_one_line_and_nothing_is_half_loaded(memory, capsys) -> None:
    """Its load raised inside protect, after the model and optimizer were loaded, on every restart: the job failed."""
    trained(memory, History())
    model, opt, sched = job()
    assert protect(model, opt, every=2, extra={"sched": sched, "history": Window(most=2)}) == 2
    err = capsys.readouterr().err
    assert "step-4 in " in err and " refused: extra 'history' could not load it (ValueError: a window holds at most " \
                                   "2 entries, not 4)\n" in err, err
    assert sched.last_epoch == 2 and snapshot.steps(memory) == [2]

    snapshot.forget_after(-1, memory)
    trained(memory, History())
    model, opt, sched = job()
    fresh = [p.clone() for p in model.parameters()]
    assert protect(model, opt, every=2, extra={"sched": sched, "history": Window(most=1)}) == 0
    assert sched.last_epoch == 0 and all(torch.equal(a, b) for a, b in zip(fresh, model.parameters(), strict=True))
    assert not opt.state and snapshot.steps(memory) == []


def test_an_object_the_optimizer_gains_after_the_call_is_said_once_and_no_snapshot_is_written(memory, capsys) -> None:
    """A loop that sets its learning rate from numpy (a float32 cosine of its own) after the call: the optimizer's
    groups gain an object a snapshot cannot hold. Checking only the extras at each snapshot wrote them, each refused
    as unreadable on the resume (weights_only): back to step 0 with nothing said while it trained."""
    import numpy as np

    model, opt, sched = job()
    protect(model, opt, every=2)
    for step in range(6):
        for group in opt.param_groups:
            group["lr"] = np.float32(0.01) * np.float32(0.9) ** step
        train(model, opt, sched, step, step + 1)
    settle(model)
    wait_for_writes()
    assert snapshot.steps(memory) == []
    err = capsys.readouterr().err
    assert err.count("no snapshot of step 2 (nor later, while it holds it): the state's /optim/param_groups/0/lr "
                     "is a numpy.float32") == 1, err
