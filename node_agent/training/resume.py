"""Which snapshot a job resumes from, for `protect` and the framework callbacks alike: the newest step every rank
holds and accepts. A rank accepts a file that reads back as a snapshot of that step, whose tensors match their
checksums and whose state fits the live one (the caller's check); a refusal is said in one line and sends every
rank to the next older step (node_agent.snapshot.agreed_step)."""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from node_agent.training import heartbeat, layout, snapshot
from node_agent.training.capture import say


def agree(where: str, fits: Callable[[dict[str, Any]], str | None]) -> tuple[int, dict[str, Any]] | None:
    """(step, the snapshot's tree) that every rank resumes from, or None. `fits(tree)` says why the tree does not
    fit this rank's live state, or None."""
    heartbeat.restore_began()
    accepted: dict[int, dict[str, Any]] = {}

    def accept(step: int) -> bool:
        tree = read(step, where)
        problem = tree if isinstance(tree, str) else fits(tree)
        if problem or isinstance(tree, str):
            say(f"step-{step} in {where} refused: {problem}")
            return False
        accepted[step] = tree
        return True

    step = snapshot.agreed_step(reduce_min, where, accept)
    return None if step is None else (step, accepted[step])


def read(step: int, where: str) -> dict[str, Any] | str:
    """The tree of the snapshot of `step`, or a line saying why it cannot be used (layout.read)."""
    return layout.read(snapshot.path(step, where), step)


def reduce_min(x: int) -> int:
    """MIN over every rank of the default process group (itself when there is none)."""
    if not (dist.is_available() and dist.is_initialized()):
        return x
    backend = str(dist.get_backend())
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    t = torch.tensor([x], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


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
