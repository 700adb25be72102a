"""Which snapshot a job resumes from, for `protect` and the framework callbacks alike: the newest step every rank
holds and accepts. A rank accepts a file that reads back as a snapshot of that step, whose tensors match their
checksums and whose state fits the live one (the caller's check); a refusal is said in one line and sends every
rank to the next older step (node_agent.snapshot.agreed_step). Where every rank's state is a replica (DDP), a rank
without the step (a node that joined a growing job, one that lost its memory) is lent the lowest holding rank's
file over the process group, and checks it as its own: the job resumes where its ranks were, not from disk."""
from __future__ import annotations

import contextlib
import os
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from node_agent.training import heartbeat, layout, snapshot, trees
from node_agent.training.capture import say


def agree(where: str, fits: Callable[[dict[str, Any]], str | None],
          replicas: bool = False) -> tuple[int, dict[str, Any], int] | None:
    """(step, the snapshot's tree, the rank whose file it is: this one's, or the replica's it was lent) that every
    rank resumes from, or None. `fits(tree)` says why the tree does not fit this rank's live state, or None.
    `replicas`: every rank's state is a replica of every other's (DDP), so a rank without the step may be lent it."""
    heartbeat.restore_began()
    accepted: dict[int, dict[str, Any]] = {}
    lender = [rank()]

    def accept(step: int) -> bool:
        tree = read(step, where)
        problem = tree if isinstance(tree, str) else fits(tree)
        if problem or isinstance(tree, str):
            say(f"step-{step} in {where} refused: {problem}")
            return False
        accepted[step] = tree
        return True

    def lend(step: int, held: bool) -> bool:
        lender[0] = lend_file(step, where, held)
        return reduce_min(1 if held or (lender[0] >= 0 and accept(step)) else 0) == 1

    step = snapshot.agreed_step(reduce_min, where, accept, lend if replicas and world() > 1 else None)
    return None if step is None else (step, accepted[step], lender[0] if lender[0] >= 0 else rank())


LEND_PIECE = 64 << 20     # bytes one broadcast of a lent file carries: one buffer, reused (a GPU holds the model)


def lend_file(step: int, where: str, held: bool) -> int:
    """Every rank calls it: the lowest rank holding `step` sends its file, a piece at a time, to every rank that does
    not, which writes it as its own. This rank's own rank where it held the step, else its lender's, or -1 where
    its copy could not be written (its directory full): every rank makes the same calls either way."""
    if reduce_min(1 if held else 0) == 1:
        return rank()                          # every rank holds it: nothing to lend
    lender = reduce_min(rank() if held else snapshot.NONE_HELD)
    me, device, final = rank(), _device(), snapshot.path(step, where)
    size = torch.tensor([os.path.getsize(final) if me == lender else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, lender)
    total = int(size.item())
    piece = torch.empty(max(1, min(LEND_PIECE, total)), dtype=torch.uint8, device=device)
    host = piece if device.type == "cpu" else torch.empty(piece.numel(), dtype=torch.uint8, pin_memory=True)
    out = None if held else _Lent(step, where)
    with open(final, "rb") if me == lender else contextlib.nullcontext() as source:
        for at in range(0, total, piece.numel()):
            n = min(piece.numel(), total - at)
            if source is not None:
                source.readinto(host[:n].numpy().data)
                if host is not piece:
                    piece[:n].copy_(host[:n])
            dist.broadcast(piece[:n], lender)
            if out is not None:
                if host is not piece:
                    host[:n].copy_(piece[:n])
                out.write(host[:n].numpy().data)
    if out is None:
        return me
    return lender if out.done() else -1


class _Lent:
    """The lent file as it comes: written beside the snapshots as step-N.tmp (the steps newer than N removed
    first: a run the job abandoned, and room for it), renamed once whole. A write that fails is said once and the
    rest of the pieces are let pass (the broadcasts go on for every rank)."""

    def __init__(self, step: int, where: str) -> None:
        self.step, self.where, self.final = step, where, snapshot.path(step, where)
        snapshot.forget_after(step, where)
        self.problem = ""
        self.file: Any = None
        try:
            self.file = open(self.final + ".tmp", "wb")  # noqa: SIM115 - written piece by piece, closed in done()
        except OSError as exc:
            self.problem = str(exc)

    def write(self, data: memoryview) -> None:
        if self.file is not None and not self.problem:
            try:
                self.file.write(data)
            except OSError as exc:
                self.problem = str(exc)

    def done(self) -> bool:
        try:
            if self.file is not None:
                self.file.close()
            if not self.problem:
                os.replace(self.final + ".tmp", self.final)
                return True
        except OSError as exc:
            self.problem = str(exc)
        snapshot.remove(self.final + ".tmp")
        say(f"step-{self.step}, lent by a replica, could not be written into {self.where}: {self.problem}")
        return False


def storages(tree: Any) -> set[int]:
    """Where the tree's tensors lie: in a read snapshot, each tensor is its own storage in the file's mapping."""
    return {at for _, t in trees.tensors(tree) if (at := _storage(t)) is not None}


def owned(tree: Any) -> Any:
    """The tree with every tensor a copy of its own, for the parts a load may keep by reference (an extra that
    keeps them, an LR scheduler, a framework's loops and callbacks, a module's extra state). What a kept tensor of
    a read snapshot costs: settle_optimizers."""
    return trees.rebuild(tree, lambda leaf: leaf.clone() if isinstance(leaf, torch.Tensor) else leaf)


def keeps(state: Any, mapped: set[int]) -> bool:
    """Whether a loaded object's state still lies in the snapshot's mapping (`mapped`: storages())."""
    return any(_storage(t) in mapped for _, t in trees.tensors(state))


def weights(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A model's state dict as its load takes it: the weights as they are (the load copies them into the module's
    own), a module's extra state a copy (`set_extra_state` may keep what it is given)."""
    return {k: owned(v) if k.endswith("_extra_state") else v for k, v in state_dict.items()}


def settle_optimizers(optimizers: Iterable[Any], mapped: set[int]) -> None:
    """After an optimizer's load, its state tensors (in lists and dicts too):
    - in the snapshot's mapping (`mapped`: storages()) get memory of their own. A load keeps a CPU tensor by
      reference, and the mapping keeps the file: its /dev/shm pages would stay allocated for the worker's life
      after the file is dropped (past the memory directory's limit), and it would never be written over. A copy
      now costs what the first step's copy-on-write faults would have;
    - shaped like their parameter but laid out otherwise take its layout: a snapshot holds tensors contiguous,
      and a fused optimizer updates a channels-last parameter's state as if laid out like it."""
    for optimizer in optimizers:
        states = getattr(optimizer, "state", {})
        for param, state in list(states.items()):
            if isinstance(state, dict):
                for key, value in list(state.items()):
                    state[key] = _settled(value, param, mapped)
            else:                   # a value under a key of its own, not a parameter's (a global step count)
                states[param] = _settled(state, None, mapped)


def _settled(value: Any, param: Any, mapped: set[int]) -> Any:
    if isinstance(value, list | tuple | dict):     # the container itself where nothing in it changes
        keys = list(value) if isinstance(value, dict) else list(range(len(value)))
        new = {k: _settled(value[k], param, mapped) for k in keys}
        if all(new[k] is value[k] for k in keys):
            return value
        if isinstance(value, dict):
            return type(value)(new) if type(value) in (dict, OrderedDict) else new
        items = [new[k] for k in keys]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
        return value
    if type(value) is torch.Tensor and isinstance(param, torch.Tensor) and not isinstance(param, DTensor) \
            and param.layout == torch.strided and value.shape == param.shape and value.stride() != param.stride():
        like = torch.empty_like(param, dtype=value.dtype, device=value.device)
        if like.stride() == param.stride():
            return like.copy_(value)
    return value.clone() if _storage(value) in mapped else value


def _storage(t: torch.Tensor) -> int | None:
    """Where a tensor's storage begins, or None for one without a plain storage (sparse, a wrapper subclass)."""
    try:
        return trees.local(t).untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError, TypeError):
        return None


def read(step: int, where: str) -> dict[str, Any] | str:
    """The tree of the snapshot of `step`, or a line saying why it cannot be used (layout.read)."""
    return layout.read(snapshot.path(step, where), step)


def reduce_min(x: int) -> int:
    """MIN over every rank of the default process group (itself when there is none)."""
    if not (dist.is_available() and dist.is_initialized()):
        return x
    t = torch.tensor([x], dtype=torch.int64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def _device() -> torch.device:
    """Where the default group's collectives take their tensors: this rank's GPU under NCCL, else the CPU."""
    backend = str(dist.get_backend())
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def lent(step: int, lender: int, what: str) -> None:
    """Said by a rank that held no snapshot of `step` and resumes from `lender`'s file (`what` it took of it)."""
    say(f"rank {rank()} held no snapshot of step {step}: it resumes from rank {lender}'s ({what})")


def resumed(step: int) -> None:
    """Said once the snapshot of `step` is loaded (the restart's anatomy: the restore ends here)."""
    heartbeat.restored()
    print(f"rank {os.environ.get('RANK', '?')}: resumed from step {step} (memory)", flush=True)


def memory_directory() -> str | None:
    """This worker's memory directory (snapshot.directory). Without one, said once per job (by rank 0): the script
    runs as it would without us."""
    where = snapshot.directory()
    if where is None and os.environ.get("RANK", "0") == "0":
        print(f"node-agent snapshot: no memory directory (${snapshot.DIR_VAR} is not set: not under node-agent, "
              "or --no-memory-dir): no snapshots are taken", file=sys.stderr, flush=True)
    return where
