"""A snapshot's GPU tensors into pinned host memory in few copies, on a stream of each GPU's own (capture.py's
thread then moves them into the file). The rules:
- Tensors under SOLO bytes are packed on their GPU into a bounce buffer of CHUNK bytes (one batched copy per
  element size, of their bits: a float copy would rewrite NaN payloads) and go to the host in one copy: a copy per
  tensor is a host call and a place in the device's queue each (a model of 1,024-wide layers with AdamW has a
  thousand tensors at 2 GiB), and a queue that fills holds the step.
- Larger tensors go on their own, straight into their pinned buffer, laid out as on the GPU where that is dense
  (a channels-last weight): a copy in another layout would need a temporary copy on the GPU.
- Each GPU's copies run on a side stream of that GPU, after what its current stream queued: a tensor's copy runs
  on the stream current for the tensor's device, whatever device is current.
- The training's stream waits (on the GPU, not the host) for the tensors the optimizer does not own as soon as they
  are copied (buffers a forward updates in place, extras), and for the rest before the optimizer's next step.
- A pinned buffer per run of packed tensors (at most CHUNK bytes) or per large tensor, not one for all: torch's
  host allocator rounds an allocation up to a power of two.
- The bounce buffer is given back to the side stream's cache after each snapshot (a full GPU can reclaim it);
  where one cannot be had, each tensor goes on its own, said once."""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

CHUNK = 32 << 20
SOLO = 8 << 20
ALIGN = 512               # a packed tensor's offset: any dtype's view may begin there

Layout = list[tuple[tuple[int, ...], torch.dtype, torch.device]]
Events = list[tuple[torch.device, torch.cuda.Event]]
Around = contextlib.AbstractContextManager[object]


@dataclass(frozen=True)
class Plan:
    """The runs a layout's tensors are copied in, in order (a run of one is copied on its own), each tensor's byte
    offset in its run, each run's bytes, and how many runs hold the tensors before the split."""
    runs: list[list[int]]
    offsets: list[int]
    ends: list[int]
    first: int


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def plan(layout: Layout, split: int | None = None) -> Plan:
    """Runs of `layout`'s tensors; none spans two devices or the `split` (the tensors before it go first)."""
    split = len(layout) if split is None else split
    runs: list[list[int]] = []
    ends: list[int] = []
    offsets = [0] * len(layout)
    run: list[int] = []
    at = end = 0
    first = 0

    def close() -> None:
        nonlocal run, at, end
        if run:
            runs.append(run)
            ends.append(end)
        run, at, end = [], 0, 0

    for i, (shape, dtype, device) in enumerate(layout):
        if i == split:
            close()
            first = len(runs)
        n = nbytes(shape, dtype)
        if n >= SOLO:
            close()
            runs.append([i])
            ends.append(n)
            continue
        if run and (at + n > CHUNK or layout[run[0]][2] != device):
            close()
        offsets[i], end = at, at + n
        at += -(-n // ALIGN) * ALIGN
        run.append(i)
    close()
    return Plan(runs, offsets, ends, first if split < len(layout) else len(runs))


class Staging:
    """The pinned buffers of one layout (the first `split` tensors copied first), and a view per tensor (`views`,
    in the layout's order) its copy lands in. `pinned(n)`: n bytes of page-locked host memory (a uint8 tensor);
    `say`: one line for the user."""

    def __init__(self, layout: Layout, pinned: Callable[[int], torch.Tensor],
                 say: Callable[[str], None] = lambda _: None, split: int | None = None) -> None:
        self.layout = layout
        self.split = len(layout) if split is None else split
        self.plan = plan(layout, self.split)
        self.buffers = [pinned(end) for end in self.plan.ends]
        self.views = [self._view(self.buffers[r], i) for r, run in enumerate(self.plan.runs) for i in run]
        self._say = say
        self._packs = any(len(run) > 1 for run in self.plan.runs)
        self._no_bounce: set[torch.device] = set()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def queue(self, live: list[torch.Tensor]) -> tuple[Events, Events, list[torch.Tensor]]:
        """Queue `live`'s copies (GPU tensors laid out as `layout`) on each device's side stream: the events after
        the first `split` tensors' copies and after all, per device, and each tensor's host view (`views`, or one
        laid out as its GPU tensor)."""
        devices = list(dict.fromkeys(t.device for t in live))
        for device in devices:
            self._side(device).wait_stream(torch.cuda.current_stream(device))

        def on_side(device: torch.device) -> Around:
            return torch.cuda.stream(self._side(device))

        out: list[torch.Tensor] = []
        bounces: dict[torch.device, torch.Tensor | None] = {}
        first: Events = []
        for part in (range(self.plan.first), range(self.plan.first, len(self.plan.runs))):
            out += self.copy(live, part, on_side, bounces)
            events = [(d, self._side(d).record_event()) for d in devices]
            first = first or events
        return first, events, out

    def copy(self, live: list[torch.Tensor], runs: range | None = None,
             around: Callable[[torch.device], Around] = lambda _: contextlib.nullcontext(),
             bounces: dict[torch.device, torch.Tensor | None] | None = None) -> list[torch.Tensor]:
        """Copy `live`'s tensors of `runs` (all by default) into their host views, each run inside `around(device)`
        (its side stream); returns the host view each landed in."""
        bounces = {} if bounces is None else bounces
        out: list[torch.Tensor] = []
        for r in range(len(self.plan.runs)) if runs is None else runs:
            run = self.plan.runs[r]
            device = live[run[0]].device
            with around(device):
                if device not in bounces:
                    bounces[device] = self._bounce_on(device)
                bounce = bounces[device] if len(run) > 1 else None
                if bounce is None:
                    for i in run:
                        out.append(_alone(self.views[i], live[i]))
                    continue
                _pack([self._view(bounce, i) for i in run], [live[i] for i in run])
                self.buffers[r].copy_(bounce[:self.plan.ends[r]], non_blocking=True)
                out += [self.views[i] for i in run]
        return out

    def _view(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        """Tensor i's place in `buffer` (its run's pinned buffer, or the bounce buffer), shaped and typed as it."""
        shape, dtype, _ = self.layout[i]
        at = self.plan.offsets[i]
        return buffer[at:at + nbytes(shape, dtype)].view(dtype).view(shape)

    def _side(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return self._streams[device]

    def _bounce_on(self, device: torch.device) -> torch.Tensor | None:
        """CHUNK bytes on `device`, allocated on the stream current there (the side stream: its cache takes it back
        when the caller drops it, and the next snapshot's is that block again)."""
        if device in self._no_bounce or not self._packs:
            return None
        try:
            return _bounce(device)
        except torch.cuda.OutOfMemoryError as exc:
            self._no_bounce.add(device)
            self._say(f"no {CHUNK >> 20} MiB free on {device} to pack a snapshot's small tensors "
                      f"({(str(exc).splitlines() or ['out of memory'])[0][:200]}): each is copied to the host on "
                      f"its own, slower")
            return None


def _bounce(device: torch.device) -> torch.Tensor:
    return torch.empty(CHUNK, dtype=torch.uint8, device=device)


def _alone(view: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """`src` into `view`'s memory; laid out as `src` where that is dense (no temporary on its device). Returns the
    view its bytes lie in."""
    if not src.is_contiguous() and _dense(src):
        view = view.reshape(-1).as_strided(src.shape, src.stride())
    view.copy_(src, non_blocking=True)
    return view


def _dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill its extent exactly, in some order of its dimensions (no gaps, no overlap)."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride(), strict=True) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _pack(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """srcs into dsts on their device: the contiguous ones as bits, in one batched copy per element size; the
    others one by one."""
    batched: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for dst, src in zip(dsts, srcs, strict=True):
        if src.numel() == 0:
            continue
        if src.is_contiguous():
            bits = _BITS[min(src.element_size(), 8)]
            to, of = batched.setdefault(bits, ([], []))
            to.append(dst.reshape(-1).view(bits))
            of.append(src.reshape(-1).view(bits))
        else:
            dst.copy_(src)
    for to, of in batched.values():
        try:
            _FOREACH_COPY(to, of)
        except RuntimeError:                # where this torch's batched copy cannot: one by one, still packed
            _copy_each(to, of)


def _copy_each(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    for dst, src in zip(dsts, srcs, strict=True):
        dst.copy_(src)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_FOREACH_COPY: Callable[[list[torch.Tensor], list[torch.Tensor]], object] = getattr(torch, "_foreach_copy_",
                                                                                    _copy_each)


def order(guarded: list[bool]) -> Iterator[int]:
    """The tensors' indices, those not `guarded` (by the optimizer's step) first, each group in its order."""
    yield from (i for i, g in enumerate(guarded) if not g)
    yield from (i for i, g in enumerate(guarded) if g)
