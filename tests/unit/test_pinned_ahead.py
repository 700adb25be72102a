"""The pinned buffers of a snapshot's GPU tensors are allocated ahead, in a thread (Capture.prepare), and the
first snapshot takes them instead of allocating in the step. There is no GPU here: page-locked allocation is
stood in for by a recording allocator, and every tensor counts as a GPU's (the selection is one comprehension)."""
from __future__ import annotations

import threading

import torch

from node_agent.training import capture, protect
from node_agent.training.capture import Capture


def fake_gpu(monkeypatch) -> list[list[tuple[tuple[int, ...], torch.dtype]]]:
    made: list[list[tuple[tuple[int, ...], torch.dtype]]] = []

    def pinned(layout):
        made.append(layout)
        return [torch.empty(shape, dtype=dtype) for shape, dtype in layout]

    monkeypatch.setattr(capture, "_pinned", pinned)
    monkeypatch.setattr(capture, "_gpu_layout", lambda live: [(tuple(t.shape), t.dtype) for t in live])
    return made


def test_the_buffers_prepared_ahead_are_the_first_snapshots(memory, monkeypatch) -> None:
    made = fake_gpu(monkeypatch)
    c = Capture(memory)
    tree = {"w": torch.zeros(3, 4), "step": torch.tensor(1, dtype=torch.int64)}
    c.prepare(tree)
    layout = [((3, 4), torch.float32), ((), torch.int64)]
    first = c._buffers(layout)                   # joins the thread
    assert made == [layout]                      # allocated once, by the thread
    assert [tuple(b.shape) for b in first] == [(3, 4), ()]
    assert c._buffers(layout) is first and made == [layout]      # the next snapshot reuses them
    c.prepare(tree)                              # already there: nothing more
    assert c._preparing is None


def test_buffers_prepared_for_another_layout_are_not_taken(memory, monkeypatch) -> None:
    made = fake_gpu(monkeypatch)
    c = Capture(memory)
    c.prepare({"w": torch.zeros(2)})
    c._buffers([((5,), torch.float32)])
    assert made == [[((2,), torch.float32)], [((5,), torch.float32)]]


def test_a_failed_allocation_ahead_leaves_it_to_the_snapshot(memory, monkeypatch) -> None:
    made = fake_gpu(monkeypatch)
    real = capture._pinned

    def fails_once(layout):
        if not made:
            made.append("failed")
            raise RuntimeError("CUDA error: out of memory")
        return real(layout)

    monkeypatch.setattr(capture, "_pinned", fails_once)
    c = Capture(memory)
    c.prepare({"w": torch.zeros(2)})
    assert [tuple(b.shape) for b in c._buffers([((2,), torch.float32)])] == [(2,)]
    assert made == ["failed", [((2,), torch.float32)]]


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        model(torch.ones(1, 2)).sum().backward()
        opt.step()


def test_protect_prepares_once_after_the_first_step(memory, monkeypatch) -> None:
    prepared = []
    monkeypatch.setattr(Capture, "prepare", lambda self, tree: prepared.append(sorted(tree["optim"]["state"])))
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
