"""A snapshot's GPU tensors into pinned host memory in few copies (capture.py queues them on a stream of its own, and
its thread moves them into the file). The rules:
- Tensors under SOLO bytes are packed on their GPU into a bounce buffer of CHUNK bytes (one batched copy per dtype)
  and go to the host in one copy: a copy per tensor is a host call and a place in the device's queue each (a
  model of 1,024-wide layers with AdamW has a thousand tensors at 2 GiB), and a queue that fills holds the step.
- Larger tensors go on their own, straight into their pinned buffer.
- A pinned buffer per run of packed tensors (at most CHUNK bytes) or per large tensor, not one for all: torch's
  host allocator rounds an allocation up to a power of two.
- Where the bounce buffer cannot be had (the GPU is full), each tensor goes on its own, as before; said once."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

CHUNK = 32 << 20
SOLO = 8 << 20
ALIGN = 512               # a packed tensor's offset: any dtype's view may begin there

Layout = list[tuple[tuple[int, ...], torch.dtype, torch.device]]


@dataclass(frozen=True)
class Plan:
    """The runs a layout's tensors are copied in, in order (a run of one is copied on its own), each tensor's byte
    offset in its run and each run's bytes."""
    runs: list[list[int]]
    offsets: list[int]
    ends: list[int]


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def plan(layout: Layout) -> Plan:
    runs: list[list[int]] = []
    ends: list[int] = []
    offsets = [0] * len(layout)
    run: list[int] = []
    at = end = 0

    def close() -> None:
        nonlocal run, at, end
        if run:
            runs.append(run)
            ends.append(end)
        run, at, end = [], 0, 0

    for i, (shape, dtype, device) in enumerate(layout):
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
    return Plan(runs, offsets, ends)


class Staging:
    """The pinned buffers of one layout, and a view per tensor (`views`, in the layout's order) that its copy lands
    in. `pinned(n)`: n bytes of page-locked host memory (a uint8 tensor); `say`: one line for the user."""

    def __init__(self, layout: Layout, pinned: Callable[[int], torch.Tensor],
                 say: Callable[[str], None] = lambda _: None) -> None:
        self.layout = layout
        self.plan = plan(layout)
        self.buffers = [pinned(end) for end in self.plan.ends]
        self.views = [self._view(self.buffers[r], i) for r, run in enumerate(self.plan.runs) for i in run]
        self._say = say
        self._bounce: dict[torch.device, torch.Tensor | None] = {}
        self._packed: dict[int, list[torch.Tensor]] = {}      # run -> its tensors' views of the bounce buffer

    def copy(self, live: list[torch.Tensor]) -> None:
        """Queue each of `live` (laid out as `layout`) into its view, on the current stream: the caller records
        an event after it and waits for it before reading the views."""
        for r, run in enumerate(self.plan.runs):
            bounce = self._bounce_on(live[run[0]].device) if len(run) > 1 else None
            if bounce is None:
                for i in run:
                    self.views[i].copy_(live[i], non_blocking=True)
                continue
            packed = self._packed.get(r)
            if packed is None:
                packed = self._packed[r] = [self._view(bounce, i) for i in run]
            _pack(packed, [live[i] for i in run])
            self.buffers[r].copy_(bounce[:self.plan.ends[r]], non_blocking=True)

    def _view(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        """Tensor i's place in `buffer` (its run's pinned buffer, or the bounce buffer), shaped and typed as it."""
        shape, dtype, _ = self.layout[i]
        at = self.plan.offsets[i]
        return buffer[at:at + nbytes(shape, dtype)].view(dtype).view(shape)

    def _bounce_on(self, device: torch.device) -> torch.Tensor | None:
        if device not in self._bounce:
            try:
                self._bounce[device] = torch.empty(CHUNK, dtype=torch.uint8, device=device)
            except (RuntimeError, MemoryError) as exc:      # torch.OutOfMemoryError is a RuntimeError
                self._bounce[device] = None
                self._say(f"no {CHUNK >> 20} MiB free on {device} to pack a snapshot's small tensors "
                          f"({(str(exc).splitlines() or [type(exc).__name__])[0][:200]}): each is copied to the host on its own, slower")
        return self._bounce[device]


def _pack(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """srcs into dsts on their device: the contiguous ones in one batched copy per dtype, the others one by one."""
    batched: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for dst, src in zip(dsts, srcs, strict=True):
        if src.numel() == 0:
            continue
        if src.is_contiguous():
            to, of = batched.setdefault(src.dtype, ([], []))
            to.append(dst)
            of.append(src)
        else:
            dst.copy_(src)
    for to, of in batched.values():
        try:
            _FOREACH_COPY(to, of)
        except RuntimeError:                # a dtype this torch's batched copy lacks: one by one, still packed
            _copy_each(to, of)


def _copy_each(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    for dst, src in zip(dsts, srcs, strict=True):
        dst.copy_(src)


_FOREACH_COPY: Callable[[list[torch.Tensor], list[torch.Tensor]], object] = getattr(torch, "_foreach_copy_",
                                                                                    _copy_each)
