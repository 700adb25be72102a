"""A snapshot's GPU tensors reach pinned memory in few copies (staging.py): the small ones packed on their device into
a bounce buffer and copied as one run. There is no GPU here: the same code runs on host tensors (a "device" copy and
a pinned buffer are both host memory), which checks the plan and that every byte lands where its view says."""
from __future__ import annotations

import torch

from node_agent.training import capture, layout, snapshot, staging
from node_agent.training.capture import Capture

CPU = torch.device("cpu")


def host(size: int) -> torch.Tensor:
    return torch.empty(size, dtype=torch.uint8)


def layout_of(tensors: list[torch.Tensor]) -> staging.Layout:
    return [(tuple(t.shape), t.dtype, t.device) for t in tensors]


def test_a_thousand_small_tensors_go_in_few_runs_and_large_ones_alone() -> None:
    mib = 1 << 20
    gpu0, gpu1 = torch.device("cuda", 0), torch.device("cuda", 1)
    shapes = [((1024, 1024), torch.float32, gpu0), ((1024,), torch.float32, gpu0)] * 500      # 4 MiB + 4 KiB
    shapes += [((4096, 4096), torch.float32, gpu0), ((3,), torch.int64, gpu0), ((7,), torch.bfloat16, gpu1)]
    plan = staging.plan(shapes)
    assert [i for run in plan.runs for i in run] == list(range(len(shapes)))       # each once, in order
    assert len(plan.runs) <= 1000 * 4 * mib // (staging.CHUNK - staging.SOLO) + 4
    for run, end in zip(plan.runs, plan.ends, strict=True):
        assert end <= staging.CHUNK or len(run) == 1
        assert len({shapes[i][2] for i in run}) == 1                               # one device a run
        assert all(plan.offsets[i] % staging.ALIGN == 0 for i in run)
        spans = [(plan.offsets[i], plan.offsets[i] + staging.nbytes(*shapes[i][:2])) for i in run]
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)) and spans[-1][1] == end
    assert [1000] in plan.runs and plan.ends[plan.runs.index([1000])] == 64 * mib    # large: on its own
    assert [1002] in plan.runs                                                        # another device


def mixed() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(40, 3), torch.randn(5).to(torch.bfloat16), torch.tensor(7), torch.rand(9) > 0.5,
            torch.empty(0, 4), torch.randn(6, 8).t(), torch.randn(300).double(), torch.randn(2, 2, dtype=torch.cfloat),
            torch.arange(33, dtype=torch.int16)] * 3


def test_every_tensor_lands_bit_for_bit_packed_or_alone(monkeypatch) -> None:
    monkeypatch.setattr(staging, "CHUNK", 4096)
    monkeypatch.setattr(staging, "SOLO", 1024)          # the 300 doubles (2,400 bytes) go on their own
    live = mixed()
    staged = staging.Staging(layout_of(live), host)
    assert len(staged.plan.runs) < len(live) // 3
    for _ in range(2):                                   # the second time through the same buffers
        staged.copy(live)
        assert all(v.dtype == t.dtype and v.shape == t.shape and torch.equal(v, t)
                   for v, t in zip(staged.views, live, strict=True))
        live = [t + 1 if t.dtype != torch.bool else ~t for t in live]


def test_a_dtype_the_batched_copy_lacks_is_packed_one_by_one(monkeypatch) -> None:
    def lacks(dsts, srcs):
        raise RuntimeError('"foreach_tensor_copy" not implemented for this dtype')

    monkeypatch.setattr(staging, "_FOREACH_COPY", lacks)
    live = mixed()
    staged = staging.Staging(layout_of(live), host)
    staged.copy(live)
    assert len(staged.plan.runs) == 1 and all(torch.equal(v, t) for v, t in zip(staged.views, live, strict=True))


def test_without_room_for_the_bounce_buffer_each_goes_on_its_own_said_once(monkeypatch) -> None:
    monkeypatch.setattr(staging, "CHUNK", 1 << 62)      # no such allocation anywhere
    said: list[str] = []
    live = mixed()
    staged = staging.Staging(layout_of(live), host, said.append)
    assert len(staged.plan.runs) == 1
    staged.copy(live)
    staged.copy(live)
    assert all(torch.equal(v, t) for v, t in zip(staged.views, live, strict=True))
    assert len(said) == 1 and "each is copied to the host on its own" in said[0]


def test_a_snapshot_staged_in_runs_reads_back_whole(memory, monkeypatch) -> None:
    """Capture's path on a GPU, stood in for on the host: the tensors staged (packed runs and lone ones), the thread
    moving each into the file as it hashes it."""
    monkeypatch.setattr(staging, "CHUNK", 4096)
    monkeypatch.setattr(staging, "SOLO", 1024)
    monkeypatch.setattr(Capture, "_staged", lambda self, shapes: staging.Staging(shapes, host))

    def copy(self, views, live):
        staged = self._buffers(layout_of(live))
        staged.copy(live)
        return list(zip(views, staged.views, strict=True))

    monkeypatch.setattr(Capture, "_copy", copy)
    tree = {"w": mixed(), "big": [torch.randn(9 << 18) for _ in range(8)]}      # over 64 MiB: the hash threads
    c = Capture(memory)
    for step in (1, 2, 3):
        c.take(step, tree)
        c.wait()
        saved = layout.read(snapshot.path(step, memory), step)
        assert isinstance(saved, dict), saved
        assert all(torch.equal(a, b) for a, b in zip(saved["w"] + saved["big"], tree["w"] + tree["big"], strict=True))
        tree = {k: [t * 2 if t.dtype != torch.bool else ~t for t in v] for k, v in tree.items()}
    assert capture._gpu_layout(tree["w"]) == []          # (host tensors: the real selection stages none)
