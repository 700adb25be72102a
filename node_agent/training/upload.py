"""A restored snapshot's tensors onto their GPUs at the copy engine's speed. They lie in pageable memory (the file's
private mapping, layout.read), and a copy from pageable memory to a GPU runs at a few GB/s: the driver stages it
through small buffers of its own, one at a time. So they go through a ring of pinned slots instead:
- threads copy the next pieces into free slots (small tensors packed together) while the GPU copies filled ones
  on a stream of its own; a slot is filled again only once its copy is done (its event);
- each tensor gets memory of its own on its GPU, laid out as in the snapshot, which the load then keeps or copies
  from (a state tensor on its parameter's device already is kept as it is);
- where no pinned memory or stream can be had, or the state is small, the tensors are left as they are: the load
  copies them, slower;
- page-locking the ring costs about as much as the copies it serves (~30 ms for 64 MiB on an H200), so a restore
  allocates it once for all its uploads, in a thread begun before its snapshot is read (Ring).
Everything is copied before `onto` returns (its stream waited for), so the tensors are any stream's to use."""
from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from node_agent.training import exit_marks, trees

SLOT_BYTES = 8 << 20
SLOTS = 8                 # one pinned allocation of 64 MiB (the host allocator rounds up to a power of two)
FILL_THREADS = max(1, min(8, os.cpu_count() or 1))
SMALL = 32 << 20          # less than this to a device goes as it is: the ring's pinning would cost more than it saves


@dataclass
class Piece:
    """`src`'s bytes (host) for `dst` (on the device), through a slot from its byte `at`."""
    src: torch.Tensor
    dst: torch.Tensor
    at: int


class Lane(Protocol):
    """How filled slots reach a device: in order, each marked done once its copies are (CudaLane)."""
    def send(self, slot: torch.Tensor, load: list[Piece], index: int) -> None: ...
    def wait(self, index: int) -> None: ...
    def finish(self) -> None: ...


class Ring:
    """A restore's ring of pinned slots, shared by its uploads (weights, then optimizer state): allocated in a
    thread from the start where `wanted` (the model holds at least SMALL bytes on GPUs), else when first asked for.
    `close()` gives it back (the restore's end)."""

    def __init__(self, wanted: bool = False) -> None:
        self._memory: torch.Tensor | None = None
        self._tried = False
        self._thread: threading.Thread | None = None
        if wanted:
            # Not a daemon: a thread stopped inside torch's allocation at exit aborts the process (capture.prepare).
            self._thread = exit_marks.mark(threading.Thread(target=self._allocate, name="node-agent restore ring"),
                                           exit_marks.DROP)
            self._thread.start()

    def memory(self) -> torch.Tensor | None:
        """The ring's pinned bytes, or None where they cannot be had."""
        self._allocated()
        if not self._tried:
            self._allocate()
        return self._memory

    def close(self) -> None:
        self._allocated()
        self._memory = None

    def _allocated(self) -> None:
        """Once the thread allocating ahead is done (if one was started)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _allocate(self) -> None:
        self._tried = True
        with contextlib.suppress(RuntimeError, AssertionError):     # no pinned memory: the uploads go as before
            self._memory = _pinned(SLOTS * SLOT_BYTES)


def _pinned(size: int) -> torch.Tensor:
    return torch.empty(size, dtype=torch.uint8, pin_memory=True)


def on_gpus(model: torch.nn.Module) -> int:
    """Bytes of `model`'s parameters and buffers on GPUs (whether a restore's Ring is worth allocating ahead)."""
    here = [trees.local(t) for t in [*model.parameters(), *model.buffers()]]      # a DTensor: this rank's shard
    return sum(t.nbytes for t in here if t.device.type == "cuda")


def onto(pairs: list[tuple[torch.Tensor, torch.device]], ring: Ring | None = None) -> list[torch.Tensor]:
    """Each host tensor, copied onto its CUDA device where one is named (the others, and all of them where the ring
    cannot be set up, returned as they are), through `ring` (a restore's) or one of its own."""
    out = [t for t, _ in pairs]
    by_device: dict[torch.device, list[int]] = {}
    for i, (t, device) in enumerate(pairs):
        if device.type == "cuda" and t.device.type == "cpu" and t.is_contiguous() and t.numel():
            by_device.setdefault(device, []).append(i)
    for device, chosen in by_device.items():
        if sum(pairs[i][0].nbytes for i in chosen) < SMALL:
            continue
        memory = (ring or Ring()).memory()
        if memory is None:
            continue
        try:
            moved = [torch.empty_like(pairs[i][0], device=device) for i in chosen]
            lane = CudaLane(device)
        except (RuntimeError, AssertionError):     # the device is full: as before
            continue
        copy([pairs[i][0] for i in chosen], moved, memory, lane)
        for i, t in zip(chosen, moved, strict=True):
            out[i] = t
    return out


def copy(srcs: list[torch.Tensor], dsts: list[torch.Tensor], ring: torch.Tensor, lane: Lane,
         slot_bytes: int = SLOT_BYTES) -> None:
    """Every `srcs[i]`'s bytes into `dsts[i]` (contiguous, same size) through `ring`'s slots of `slot_bytes`."""
    slots = [ring[k * slot_bytes:(k + 1) * slot_bytes] for k in range(len(ring) // slot_bytes)]
    filling: deque[tuple[int, list[Piece], Future[None]]] = deque()
    with ThreadPoolExecutor(FILL_THREADS, thread_name_prefix="node-agent restore") as pool:
        try:
            for index, load in enumerate(loads(srcs, dsts, slot_bytes)):
                while filling and filling[0][0] <= index - len(slots):   # the slot's last load sent first
                    _send(filling.popleft(), slots, lane)
                lane.wait(index - len(slots))                            # and copied
                filling.append((index, load, pool.submit(_fill, slots[index % len(slots)], load)))
            while filling:
                _send(filling.popleft(), slots, lane)
        finally:
            for _, _, pending in filling:       # a failure: no thread still writing a slot, no copy left queued
                with contextlib.suppress(Exception):
                    pending.result()
            lane.finish()


def loads(srcs: list[torch.Tensor], dsts: list[torch.Tensor], size: int) -> Iterator[list[Piece]]:
    """What each slot carries, in order: pieces of at most `size` bytes, small tensors packed into one slot."""
    load: list[Piece] = []
    used = 0
    for src, dst in zip(srcs, dsts, strict=True):
        s, d = _bytes(src), _bytes(dst)
        start = 0
        while start < len(s):
            if used == size:
                yield load
                load, used = [], 0
            n = min(size - used, len(s) - start)
            load.append(Piece(s[start:start + n], d[start:start + n], used))
            used += n
            start += n
    if load:
        yield load


class CudaLane:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        # After what the current stream queued: the memory written here may have been freed by kernels still queued
        # there (the caching allocator hands a block back at once, for the stream it was used on).
        self.stream.wait_stream(torch.cuda.current_stream(device))
        self.done: dict[int, torch.cuda.Event] = {}

    def send(self, slot: torch.Tensor, load: list[Piece], index: int) -> None:
        with torch.cuda.stream(self.stream):
            for p in load:
                p.dst.copy_(slot[p.at:p.at + len(p.src)], non_blocking=True)
            self.done[index] = self.stream.record_event()

    def wait(self, index: int) -> None:
        event = self.done.pop(index, None)
        if event is not None:
            event.synchronize()

    def finish(self) -> None:
        self.stream.synchronize()


def _send(entry: tuple[int, list[Piece], Future[None]], slots: list[torch.Tensor], lane: Lane) -> None:
    index, load, filled = entry
    filled.result()
    lane.send(slots[index % len(slots)], load, index)


def _fill(slot: torch.Tensor, load: list[Piece]) -> None:
    for p in load:
        slot[p.at:p.at + len(p.src)].copy_(p.src)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def weights_onto(saved: dict[str, Any], live: dict[str, Any], ring: Ring | None = None) -> dict[str, Any]:
    """A model's saved state dict with each tensor whose live counterpart is on a GPU copied onto that GPU (the load
    then copies it on the device): a second copy of the weights for the load's time, so only where a GPU has twice
    that free (else they go as they are). `freed()` after the load gives that memory back."""
    keys = [k for k, v in saved.items() if isinstance(v, torch.Tensor) and isinstance(live.get(k), torch.Tensor)]
    devices = {k: trees.local(live[k]).device for k in keys}
    need: dict[torch.device, int] = {}
    for k in keys:
        need[devices[k]] = need.get(devices[k], 0) + saved[k].nbytes
    roomy = {d for d, n in need.items() if d.type == "cuda" and 2 * n <= _free(d)}
    keys = [k for k in keys if devices[k] in roomy]
    moved = onto([(saved[k], devices[k]) for k in keys], ring)
    return {**saved, **dict(zip(keys, moved, strict=True))}


def freed() -> None:
    """The weights' second copy (weights_onto), dropped by its load, back to the driver: NCCL and cuBLAS allocate
    outside torch's cache."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.empty_cache()


def _free(device: torch.device) -> int:
    try:
        return int(torch.cuda.mem_get_info(device)[0])
    except (RuntimeError, AssertionError):
        return 0


def optimizer_state_onto(saved: dict[str, Any], optimizer: torch.optim.Optimizer,
                         ring: Ring | None = None) -> dict[str, Any]:
    """An optimizer's saved state dict with each state tensor a stock load moves to its parameter's GPU (all but
    `step`, which stays where a non-fused optimizer keeps it) copied onto that GPU: the load keeps it as it is. An
    optimizer with a load of its own, or a state that is not its, is left to its load."""
    stock = torch.optim.Optimizer
    if not (isinstance(saved, dict) and isinstance(saved.get("state"), dict)) or \
            type(optimizer).load_state_dict is not stock.load_state_dict or \
            type(optimizer)._process_value_according_to_param_policy is not \
            stock._process_value_according_to_param_policy:
        return saved
    try:
        ids = [i for g in saved["param_groups"] for i in g["params"]]
    except (KeyError, TypeError):
        return saved
    live = [p for g in optimizer.param_groups for p in g["params"]]
    if len(ids) != len(live):              # not this optimizer's: its load says so
        return saved
    params = dict(zip(ids, live, strict=True))
    state = {i: dict(entry) if isinstance(entry, dict) else entry for i, entry in saved["state"].items()}
    places = [(i, k) for i, entry in state.items() if isinstance(entry, dict) and i in params
              for k, v in entry.items() if k != "step" and isinstance(v, torch.Tensor)]
    moved = onto([(state[i][k], trees.local(params[i]).device) for i, k in places], ring)
    for (i, k), t in zip(places, moved, strict=True):
        state[i][k] = t
    return {**saved, "state": state}
