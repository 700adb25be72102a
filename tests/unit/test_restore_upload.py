"""The restore's ring of pinned slots (node_agent/training/upload.py), on a CPU: a lane that copies a slot only when
its copy is waited for, as a GPU's stream may, so a slot filled again too early shows as wrong bytes."""
from __future__ import annotations

import threading

import pytest
import torch

from node_agent.training import upload


class LateLane:
    """Copies each sent slot at the latest moment a GPU could: when its index is waited for, or at the end."""

    def __init__(self) -> None:
        self.queued: dict[int, tuple[torch.Tensor, list[upload.Piece]]] = {}
        self.sent: list[int] = []
        self.lock = threading.Lock()

    def send(self, slot: torch.Tensor, load: list[upload.Piece], index: int) -> None:
        self.sent.append(index)
        self.queued[index] = (slot, load)

    def wait(self, index: int) -> None:
        if index in self.queued:
            self._run(index)

    def finish(self) -> None:
        for index in sorted(self.queued):
            self._run(index)

    def _run(self, index: int) -> None:
        slot, load = self.queued.pop(index)
        for p in load:
            p.dst.copy_(slot[p.at:p.at + len(p.src)])


def _tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(3,), (1000,), (7, 13), (0,), (4096,), (1,), (257, 3), (50_000,), (2, 2, 2)]
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.float32, torch.uint8, torch.float64, torch.float16,
              torch.float32, torch.int32]
    return [torch.randint(0, 255, shape, generator=g, dtype=torch.int64).to(dtype) if dtype in
            (torch.int64, torch.uint8, torch.int32) else torch.randn(shape, generator=g).to(dtype)
            for shape, dtype in zip(shapes, dtypes, strict=True)]


@pytest.mark.parametrize(("slot_bytes", "slots"), [(64, 2), (4096, 3), (1000, 8), (1 << 20, 2)])
def test_every_byte_arrives_though_the_device_copies_late(slot_bytes: int, slots: int) -> None:
    srcs = _tensors(slot_bytes)
    dsts = [torch.full_like(t, 0) for t in srcs]
    lane = LateLane()
    upload.copy(srcs, dsts, torch.empty(slots * slot_bytes, dtype=torch.uint8), lane, slot_bytes)
    for src, dst in zip(srcs, dsts, strict=True):
        assert torch.equal(src, dst)
    assert lane.sent == sorted(lane.sent) and not lane.queued


def test_small_tensors_share_a_slot_and_large_ones_are_cut_to_it() -> None:
    srcs = [torch.zeros(10, dtype=torch.uint8), torch.zeros(20, dtype=torch.uint8), torch.zeros(150, dtype=torch.uint8)]
    got = [[(len(p.src), p.at) for p in load] for load in upload.loads(srcs, [t.clone() for t in srcs], 64)]
    assert got == [[(10, 0), (20, 10), (34, 30)], [(64, 0)], [(52, 0)]]


def test_a_failing_send_leaves_no_thread_writing_and_says_why() -> None:
    class Broken(LateLane):
        def send(self, slot: torch.Tensor, load: list[upload.Piece], index: int) -> None:
            if index == 3:
                raise RuntimeError("CUDA error: an illegal memory access")
            super().send(slot, load, index)

    srcs = [torch.arange(10_000, dtype=torch.float32)]
    with pytest.raises(RuntimeError, match="illegal memory access"):
        upload.copy(srcs, [torch.empty_like(srcs[0])], torch.empty(4 * 1024, dtype=torch.uint8), Broken(), 1024)
    assert not [t for t in threading.enumerate() if t.name.startswith("node-agent restore")]


def test_host_tensors_stay_where_no_gpu_is_named() -> None:
    t = torch.ones(5)
    assert upload.onto([(t, torch.device("cpu"))])[0] is t


def test_a_stock_optimizer_sends_all_but_step_and_one_with_its_own_load_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[tuple[int, ...], str]] = []

    def onto(pairs: list[tuple[torch.Tensor, torch.device]], ring: upload.Ring | None = None) -> list[torch.Tensor]:
        asked.extend((tuple(t.shape), str(d)) for t, d in pairs)
        return [t + 1 for t, _ in pairs]

    monkeypatch.setattr(upload, "onto", onto)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    saved = opt.state_dict()
    out = upload.optimizer_state_onto(saved, opt)
    assert sorted(asked) == [((2,), "cpu"), ((2,), "cpu"), ((2, 3), "cpu"), ((2, 3), "cpu")]
    assert out["state"][0]["step"] is saved["state"][0]["step"]
    assert torch.equal(out["state"][0]["exp_avg"], saved["state"][0]["exp_avg"] + 1)

    class OwnLoad(torch.optim.AdamW):
        def load_state_dict(self, state_dict: dict) -> None:  # type: ignore[override, type-arg]
            super().load_state_dict(state_dict)

    asked.clear()
    own = OwnLoad(model.parameters())
    assert upload.optimizer_state_onto(saved, own) is saved and not asked


def test_a_restores_ring_is_allocated_once_ahead_in_a_thread_or_when_first_asked_for(
        monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[str] = []

    def pinned(size: int) -> torch.Tensor:
        made.append(threading.current_thread().name)
        return torch.zeros(size // 1024, dtype=torch.uint8)     # (a CPU build has no pinned memory)

    monkeypatch.setattr(upload, "_pinned", pinned)
    ahead = upload.Ring(wanted=True)
    first = ahead.memory()
    assert first is not None and ahead.memory() is first and made == ["node-agent restore ring"]
    ahead.close()
    assert ahead.memory() is None and made == ["node-agent restore ring"]     # closed: given back, not again
    asked = upload.Ring()
    assert made == ["node-agent restore ring"]            # nothing until asked for
    assert asked.memory() is not None and asked.memory() is not None
    assert made == ["node-agent restore ring", threading.current_thread().name]
    assert not [t for t in threading.enumerate() if t.name == "node-agent restore ring"]


def test_a_ring_without_pinned_memory_is_none_and_asked_for_once(monkeypatch: pytest.MonkeyPatch) -> None:
    tries: list[int] = []

    def no_pinned(size: int) -> torch.Tensor:
        tries.append(size)
        raise RuntimeError("no CUDA")

    monkeypatch.setattr(upload, "_pinned", no_pinned)
    ring = upload.Ring(wanted=True)
    assert ring.memory() is None and ring.memory() is None and len(tries) == 1
    ring.close()


def test_a_cpu_model_wants_no_ring_ahead() -> None:
    model = torch.nn.Linear(64, 64)
    assert upload.on_gpus(model) == 0 and upload.on_gpus(model) < upload.SMALL
