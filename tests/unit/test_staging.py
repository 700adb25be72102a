"""A snapshot's GPU tensors reach pinned memory in few copies (staging.py): the small ones packed on their device into
a bounce buffer and copied as one run. There is no GPU here: the same code runs on host tensors (a "device" copy and
a pinned buffer are both host memory), which checks the plan and that every byte lands where its view says."""
from __future__ import annotations

import os

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
    nan_payloads = torch.tensor([0x7F81, 0xFFC1 - 0x10000, 0x7FA5, 1], dtype=torch.int16).view(torch.bfloat16)
    last = torch.channels_last
    return [torch.randn(40, 3), torch.randn(5).to(torch.bfloat16), torch.tensor(7), torch.rand(9) > 0.5,
            torch.empty(0, 4), torch.randn(6, 8).t(), torch.randn(300).double(), torch.randn(2, 2, dtype=torch.cdouble),
            torch.arange(33, dtype=torch.int16), nan_payloads, torch.randn(2, 3, 4, 5).to(memory_format=last),
            torch.randn(4, 8, 4, 4).to(memory_format=last), torch.randn(40, 40)[:, ::2]] * 3


def test_every_tensor_lands_bit_for_bit_packed_or_alone(monkeypatch) -> None:
    monkeypatch.setattr(staging, "CHUNK", 4096)
    monkeypatch.setattr(staging, "SOLO", 1024)      # over 1,024 bytes, alone: the doubles, the 4x8x4x4, the slice
    live = mixed()
    staged = staging.Staging(layout_of(live), host)
    assert len(staged.plan.runs) < len(live) // 2
    for n in range(2):                                   # the second time through the same buffers
        if n:
            live = [t if t.dtype == torch.bfloat16 else t + 1 if t.dtype != torch.bool else ~t for t in live]
        hosts = staged.copy(live)
        assert all(v.dtype == t.dtype and v.shape == t.shape and bits(v) == bits(t)
                   for v, t in zip(hosts, live, strict=True))
    # a dense layout other than contiguous (channels-last) lands as it is, alone: no temporary copy on its device
    assert [h.stride() == t.stride() for h, t in zip(hosts, mixed(), strict=True)][10:13] == [False, True, False]


def bits(t: torch.Tensor) -> bytes:
    """Its bytes in its logical order (NaN payloads too: torch.equal would call two NaNs unequal)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_a_dtype_the_batched_copy_lacks_is_packed_one_by_one(monkeypatch) -> None:
    def lacks(dsts, srcs):
        raise RuntimeError('"foreach_tensor_copy" not implemented for this dtype')

    monkeypatch.setattr(staging, "_FOREACH_COPY", lacks)
    live = mixed()
    staged = staging.Staging(layout_of(live), host)
    hosts = staged.copy(live)
    assert all(bits(v) == bits(t) for v, t in zip(hosts, live, strict=True))


def test_without_room_for_the_bounce_buffer_each_goes_on_its_own_said_once(monkeypatch) -> None:
    def full(device):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 MiB")

    monkeypatch.setattr(staging, "_bounce", full)
    said: list[str] = []
    live = mixed()
    staged = staging.Staging(layout_of(live), host, said.append)
    assert len(staged.plan.runs) == 1
    staged.copy(live)
    hosts = staged.copy(live)
    assert all(bits(v) == bits(t) for v, t in zip(hosts, live, strict=True))
    assert len(said) == 1 and "each is copied to the host on its own" in said[0]


def test_a_snapshot_staged_in_runs_reads_back_whole(memory, monkeypatch) -> None:
    """Capture's path on a GPU, stood in for on the host: the tensors staged (packed runs and lone ones), the thread
    moving each into the file as it hashes it."""
    monkeypatch.setattr(staging, "CHUNK", 4096)
    monkeypatch.setattr(staging, "SOLO", 1024)
    monkeypatch.setattr(Capture, "_staged", lambda self, shapes, split=None: staging.Staging(shapes, host, split=split))

    def copy(self, views, live, optimizers):
        staged = self._buffers(layout_of(live))
        return list(zip(views, staged.copy(live), strict=True)), []

    monkeypatch.setattr(Capture, "_copy", copy)
    tree = {"w": mixed(), "big": [torch.randn(9 << 18) for _ in range(8)]}      # over 64 MiB: the hash threads
    c = Capture(memory)
    for step in (1, 2, 3):
        c.take(step, tree)
        c.wait()
        saved = layout.read(snapshot.path(step, memory), step)
        assert isinstance(saved, dict), saved
        assert all(bits(a) == bits(b) for a, b in zip(saved["w"] + saved["big"], tree["w"] + tree["big"], strict=True))
        tree = {k: [t * 2 if t.dtype != torch.bool else ~t for t in v] for k, v in tree.items()}
    assert not [t for t in tree["w"] if capture._on_gpu(t)]      # (host tensors: the real selection stages none)


def test_what_the_optimizer_does_not_own_is_copied_first() -> None:
    """Buffers a forward changes in place (a BatchNorm's running stats) and extras go first: the training's stream
    waits for their copy at once; the weights and the optimizer's state are waited for at the optimizer's step."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    scale = torch.tensor(1024.0)
    tree = {"model": model.state_dict(), "optim": opt.state_dict(), "extra": {"scale": scale}}
    from node_agent.training import trees
    held = trees.tensors(tree)
    live = [t for _, t in held]
    order, split = capture._gpu_order(live, [opt])      # (the real selection: host tensors are not a GPU's)
    assert order == [] and split == 0
    saved = capture._on_gpu
    try:
        capture._on_gpu = lambda t: True
        order, split = capture._gpu_order(live, [opt])
    finally:
        capture._on_gpu = saved
    first = sorted(path for k, (path, _) in enumerate(held) if k in order[:split])
    assert first == sorted(["/model/1.running_mean", "/model/1.running_var", "/model/1.num_batches_tracked",
                            "/extra/scale"]), first
    assert sorted(order) == list(range(len(live))) and len(order) - split == 4 + 4 * 3   # 4 weights; 4 x AdamW's 3


def test_a_copy_that_fails_ends_no_training_and_leaves_no_file(memory, monkeypatch, capsys) -> None:
    """Page-locking refused, the GPU out of memory for a copy's temporary, any CUDA error: said once, the snapshot's
    file removed, the training goes on and the next snapshot is taken."""
    def fails(self, views, live, optimizers):
        raise RuntimeError("CUDA error: out of memory")

    tree = {"w": torch.randn(64)}
    c = Capture(memory)
    with monkeypatch.context() as patched:
        patched.setattr(Capture, "_copy", fails)
        c.take(1, tree)
        c.take(2, tree)
    c.wait()
    assert snapshot.steps(memory) == [] and not [n for n in os.listdir(memory) if n.endswith(".tmp")]
    said = capsys.readouterr().err
    assert said.count("not written: RuntimeError: CUDA error: out of memory") == 1, said
    c.take(3, tree)
    c.wait()
    assert snapshot.steps(memory) == [3]


def test_what_fails_after_a_snapshot_is_complete_keeps_it_and_says_it_was_written(memory, monkeypatch,
                                                                                   capsys) -> None:
    """The file renamed, a failure after it (the digest told to the probe) is no failed snapshot: the snapshot stays
    and the line says it was written."""
    def fails(step: int, value: int, group: int = 0) -> None:
        raise OSError("probe gone")

    monkeypatch.setattr(capture.heartbeat, "digest", fails)
    c = Capture(memory, replicated=lambda path: True)
    c.take(1, {"w": torch.randn(64)})
    c.wait()
    assert snapshot.steps(memory) == [1]
    said = capsys.readouterr().err
    assert "snapshot of step 1 written, but what follows it failed: OSError: probe gone" in said, said
    assert "not written" not in said, said


def test_an_optimizer_whose_state_cannot_be_read_leaves_every_copy_to_its_step(monkeypatch) -> None:
    """(A wrapper whose `state` raises, say): the snapshot is still taken, every copy waited for at the step."""
    class Odd:
        param_groups: list = []

        @property
        def state(self):
            raise RuntimeError("no state here")

    monkeypatch.setattr(capture, "_on_gpu", lambda t: True)
    live = [torch.zeros(2), torch.ones(3)]
    assert capture._gpu_order(live, [Odd()]) == ([0, 1], 0)
