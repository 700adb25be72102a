"""Which snapshot a job resumes from, for `protect` and the framework callbacks alike: the newest step every rank
holds and accepts. A rank accepts a file that reads back as a snapshot of that step, whose tensors match their
checksums and whose state fits the live one (the caller's check); a refusal is said in one line and sends every
rank to the next older step (node_agent.snapshot.agreed_step). Where every rank's state is a replica (DDP), a rank
without the step (a node that joined a growing job, one that lost its memory) is lent the lowest holding rank's
file over the process group, and checks it as its own: the job resumes where its ranks were, not from disk."""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from node_agent.training import heartbeat, layout, snapshot
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


def lend_file(step: int, where: str, held: bool) -> int:
    """Every rank calls it: the lowest rank holding `step` sends its file to every rank that does not, which writes
    it as its own. The lender's rank, or -1 where this rank's copy could not be written (its directory full)."""
    if reduce_min(1 if held else 0) == 1:
        return rank()                          # every rank holds it: nothing to lend
    lender = reduce_min(rank() if held else snapshot.NONE_HELD)
    device = _device()
    size = torch.tensor([os.path.getsize(snapshot.path(step, where)) if rank() == lender else 0],
                        dtype=torch.int64, device=device)
    dist.broadcast(size, lender)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    if rank() == lender:
        with open(snapshot.path(step, where), "rb") as f:
            f.readinto(data.numpy().data)
    sent = data.to(device)
    dist.broadcast(sent, lender)
    if held:
        return lender
    final = snapshot.path(step, where)
    try:
        with open(final + ".tmp", "wb") as f:
            f.write(sent.cpu().numpy().data)
        os.replace(final + ".tmp", final)
    except OSError as exc:
        snapshot.remove(final + ".tmp")
        say(f"step-{step} lent by rank {lender} could not be written into {where}: {exc}")
        return -1
    return lender


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
