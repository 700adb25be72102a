"""The pinned buffers of a snapshot's GPU tensors are allocated ahead, in a thread (Capture.prepare), and the
first snapshot takes them instead of allocating in the step. There is no GPU here: page-locked allocation is
stood in for by a recording allocator, and every tensor counts as a GPU's (the selection is one comprehension)."""
from __future__ import annotations

import threading

import torch

from node_agent.training import capture, protect, staging
from node_agent.training.capture import Capture

CPU = torch.device("cpu")


def host(size: int) -> torch.Tensor:
    return torch.empty(size, dtype=torch.uint8)


def fake_gpu(monkeypatch) -> list[staging.Layout]:
    made: list[staging.Layout] = []

    def staged(self, layout, split=None):
        made.append(layout)
        return staging.Staging(layout, host, split=split)

    monkeypatch.setattr(Capture, "_staged", staged)
    monkeypatch.setattr(capture, "_on_gpu", lambda t: True)
    return made


def test_the_buffers_prepared_ahead_are_the_first_snapshots(memory, monkeypatch) -> None:
    made = fake_gpu(monkeypatch)
    c = Capture(memory)
    tree = {"w": torch.zeros(3, 4), "step": torch.tensor(1, dtype=torch.int64)}
    c.prepare(tree)
    layout = [((3, 4), torch.float32, CPU), ((), torch.int64, CPU)]
    first = c._buffers(layout)                   # joins the thread
    assert made == [layout]                      # allocated once, by the thread
    assert [tuple(b.shape) for b in first.views] == [(3, 4), ()]
    assert c._buffers(layout) is first and made == [layout]      # the next snapshot reuses them
    c.prepare(tree)                              # already there: nothing more
    assert c._preparing is None


def test_buffers_prepared_for_another_layout_are_not_taken(memory, monkeypatch) -> None:
    made = fake_gpu(monkeypatch)
    c = Capture(memory)
    c.prepare({"w": torch.zeros(2)})
    c._buffers([((5,), torch.float32, CPU)])
    assert made == [[((2,), torch.float32, CPU)], [((5,), torch.float32, CPU)]]


def test_a_failed_allocation_ahead_leaves_it_to_the_snapshot(memory, monkeypatch) -> None:
    fake_gpu(monkeypatch)
    made: list[object] = []

    def fails_once(size):
        if not made:
            made.append("failed")
            raise RuntimeError("CUDA error: out of memory")
        made.append(size)
        return host(size)

    monkeypatch.setattr(capture, "_pinned", fails_once)
    monkeypatch.setattr(Capture, "_staged", lambda self, layout, split=None: staging.Staging(layout, capture._pinned))
    c = Capture(memory)
    c.prepare({"w": torch.zeros(2)})
    assert [tuple(b.shape) for b in c._buffers([((2,), torch.float32, CPU)]).views] == [(2,)]
    assert made == ["failed", 8]


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        model(torch.ones(1, 2)).sum().backward()
        opt.step()


def test_protect_prepares_once_after_the_first_step(memory, monkeypatch) -> None:
    prepared = []
    monkeypatch.setattr(Capture, "prepare",
                        lambda self, tree, optimizers=(): prepared.append(sorted(tree["optim"]["state"])))
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    protect(model, opt, every=5)
    train(model, opt, 3)
    assert prepared == [[0, 1]]                  # once, with the optimizer's state made by the first step


def test_a_model_on_the_cpu_pins_nothing(memory, monkeypatch) -> None:
    pinned = []
    monkeypatch.setattr(capture, "_pinned", lambda layout: pinned.append(layout) or [])
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    protect(model, opt, every=2)
    train(model, opt, 3)
    model(torch.ones(1, 2))                      # the snapshot of step 2 is taken
    assert pinned == [] and not [t for t in threading.enumerate() if t.name == "node-agent pinned buffers"]


EXIT_SCRIPT = r"""
import sys, torch
from node_agent.training import capture, protect
def slow(size):               # page-locking stood in for: a long allocation, the GIL released inside
    [torch.zeros(2**27) for _ in range(3)]
    return torch.empty(size, dtype=torch.uint8)
capture._pinned = slow
capture._on_gpu = lambda t: True
model = torch.nn.Linear(64, 64)
opt = torch.optim.AdamW(model.parameters())
protect(model, opt, every=5)
model(torch.ones(2, 64)).sum().backward()
opt.step()                    # the first step: the buffers' thread starts
print("done", flush=True)     # and the script ends while it allocates
"""


def test_a_script_that_ends_while_the_buffers_are_allocated_exits_0(memory) -> None:
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=root))
    assert (out.returncode, out.stdout.strip()) == (0, "done"), out.stderr[-2000:]


class OnGpu:
    """A LightningModule mixin that says it is on a GPU (only Snapshots' check reads it here)."""

    @property
    def device(self) -> torch.device:
        return torch.device("cuda")


def test_lightning_prepares_once_the_optimizer_has_state_not_at_an_accumulated_micro_batch(memory, monkeypatch):
    import lightning.pytorch as L

    from node_agent.training.lightning import Snapshots
    made = fake_gpu(monkeypatch)

    class Tiny(OnGpu, L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(8, 8)

        def training_step(self, batch, _):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 8)), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, accumulate_grad_batches=2, logger=False,
                        callbacks=[Snapshots(every=4)], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Tiny(), data)
    snapshots = next(c for c in trainer.callbacks if isinstance(c, Snapshots))
    if snapshots._capture._preparing is not None:
        snapshots._capture._preparing.join()
    assert [len(layout) for layout in made] == [2 + 2 * 3]    # weights, then AdamW's exp_avg, exp_avg_sq, step


def test_the_thread_moves_a_gpus_staged_copies_into_the_file_while_it_hashes(memory, monkeypatch) -> None:
    """On a GPU `take` only queues the copies into pinned buffers; the thread copies each into the file in the thread
    that hashes it (layout.digests' fill). Stood in for by host buffers, the views left unwritten by `take`."""
    from node_agent.training import layout, snapshot
    monkeypatch.setattr(Capture, "_copy", lambda self, views, live, optimizers:
                        ([(v, t.clone()) for v, t in zip(views, live, strict=True)], []))
    for size in (1000, 9 << 20):                 # the serial path, and the threads' (over 64 MiB in all)
        tree = {"w": [torch.randn(size) for _ in range(8)], "n": torch.arange(5)}
        c = Capture(memory)
        c.take(size, tree)
        c.wait()
        saved = layout.read(snapshot.path(size, memory), size)
        assert isinstance(saved, dict), saved
        assert all(torch.equal(a, b) for a, b in zip(saved["w"] + [saved["n"]], tree["w"] + [tree["n"]], strict=True))
