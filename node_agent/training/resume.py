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

    step = snapshot.agreed_step(reduce_min, where, accept, lend if replicas and world() > 1 else None, reduce_sum)
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
        try:      # a new file: never one a name there already points to (a symlink's target: written through)
            snapshot.remove(self.final + ".tmp")
            self.file = os.fdopen(os.open(self.final + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                                          | os.O_CLOEXEC, 0o600), "wb")
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


def read(step: int, where: str) -> dict[str, Any] | str:
    """The tree of the snapshot of `step`, or a line saying why it cannot be used (layout.read)."""
    return layout.read(snapshot.path(step, where), step)


def reduce_min(x: int) -> int:
    """MIN over every rank of the default process group (itself when there is none)."""
    return _reduce(x, dist.ReduceOp.MIN)


def reduce_sum(x: int) -> int:
    """SUM over every rank of the default process group (itself when there is none)."""
    return _reduce(x, dist.ReduceOp.SUM)


def _reduce(x: int, op: Any) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return x
    t = torch.tensor([x], dtype=torch.int64, device=_device())
    dist.all_reduce(t, op=op)
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


def everywhere(where: str | None) -> bool:
    """Whether every rank has a memory directory. Every rank calls it, with one or without, before `agree`: a rank
    without one (its node's agent runs with --no-memory-dir) that skipped the agreement would meet the others'
    collectives with its training's (a review: every rank of the job aborted, "collective mismatch", on every
    restart). Where one lacks it no step is held by every rank: every rank takes the fallback. Not under node-agent
    ($NODE_AGENT_MEMORY_DIR unset on every rank, empty where the agent gives none) there is nothing to ask: the
    script runs as it would without us, no collective added."""
    if snapshot.DIR_VAR not in os.environ:
        return where is not None
    if reduce_min(1 if where is not None else 0) == 1:
        return True
    if where is None:
        return False
    # As an agreement that finds no step: these snapshots are not the job's future (they would outlive the fallback's
    # and be resumed later)
    snapshot.agreed_step(lambda _: -1, where)
    if rank() == 0:
        print("node-agent snapshot: a rank of the job has no memory directory (its node runs with --no-memory-dir): "
              "no snapshot is resumed, every rank starts from the fallback", file=sys.stderr, flush=True)
    return False


def memory_directory() -> str | None:
    """This worker's memory directory (snapshot.directory). Without one, said once per job (by rank 0): the script
    runs as it would without us."""
    where = snapshot.directory()
    if where is None and os.environ.get("RANK", "0") == "0":
        print(f"node-agent snapshot: no memory directory (${snapshot.DIR_VAR} is not set: not under node-agent, "
              "or --no-memory-dir): no snapshots are taken", file=sys.stderr, flush=True)
    return where


# A snapshot notes which fit of its process took it (Lightning's fit, the Trainer's train(), a `protect` call: the
# script's first, second, ...), and only the same fit resumes from it. Unnoted, a script's second fit (a second
# phase, a new Trainer, a second protect for a new optimizer) resumed from the first one's snapshots with no crash at
# all and skipped its own steps, and a restarted worker's first fit resumed from the second's.
FIT = "node_agent_fit"
_fits = [0]


def next_fit() -> int:
    """The number of this process's framework fits begun before this one (0: the script's first). `protect` counts
    its calls itself (protection._next_call)."""
    _fits[0] += 1
    return _fits[0] - 1


def other_fit(tree: dict[str, Any], fit: int, what: str = "fit") -> str | None:
    """Why a snapshot is not this fit's to resume from, or None (`what` the script does: a fit, a protect call)."""
    saved = tree.get(FIT, 0)
    return None if saved == fit else (f"taken by the script's {what} number {saved + 1}, and this is its {what} "
                                      f"number {fit + 1} (each resumes from its own snapshots only)")
