"""A node's own snapshots, served to the node that takes its place while it still lives (a suspect swapped for a
spare: rdzv_server/core/swaps.py), over the copy wire's fetch. The key is the node's own copy token (a newcomer
learns it from the server only with the place: Assignment.copies_token), the files its ranks' memory directories,
the trailer the checksum of the bytes as sent (each snapshot carries its own checks: training/snapshot.py). A drop
of them is answered and ignored: they are the node's own, not copies."""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from node_agent.training import snapshot


@dataclass(frozen=True)
class OwnSnapshots:
    node: str                                # this node's id
    key: Callable[[], str]                   # its copy token now ("": none, nothing is served)
    dirs: Callable[[], dict[int, str]]       # its local ranks' memory directories, of its last round

    def open(self, rank: int, want: int | None = None) -> tuple[int, int, str] | None:
        """(open fd, step, path) of local rank `rank`'s snapshot (the newest, or step `want`), or None. A snapshot
        the rank rotates away between looking and opening: look again."""
        where = self.dirs().get(rank)
        for _ in range(3):
            try:
                held = snapshot.steps(where) if where is not None else []
            except OSError:           # the directory went with the job
                return None
            step = max(held, default=None) if want is None else want if want in held else None
            if step is None or where is None:
                return None
            path = snapshot.path(step, where)
            try:
                return os.open(path, os.O_RDONLY | os.O_CLOEXEC), step, path
            except FileNotFoundError:
                continue
        return None
