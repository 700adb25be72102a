"""A node's own snapshots, served to the node that takes its place while it still lives (a suspect swapped for a
spare: rdzv_server/core/swaps.py), over the copy wire's fetch. The key is the node's own copy token (a newcomer
learns it from the server only with the place: Assignment.copies_token), the files its ranks' memory directories,
the trailer the checksum of the bytes as sent (each snapshot carries its own checks: training/snapshot.py). A drop
of them is answered and ignored: they are the node's own, not copies.
A node's next agent (its agent restarted) serves the memory it took up before its own first round, with the token its
previous agent kept there (`keep_token`, `left_key`): back with another number of workers, it waits as the spare
while a spare of its old size takes its place and fetches that memory from it, the node's newest state (a review:
refused for want of a key, the spare fell back to the older peer copy, a snapshot interval redone)."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass

from node_agent.training import snapshot

TOKEN = "copy-token"     # in the node's memory directory: its agent's copy token now, for its next agent


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


def keep_token(root: str | None, token: str) -> None:
    """Keep the agent's copy token in the node's memory directory (0600, renamed into place; not where it cannot
    be written: that agent's memory is then served by the holders' copies only)."""
    if root is None or not token or left_key(root) == token:
        return
    path = os.path.join(root, TOKEN)
    with contextlib.suppress(OSError):
        fd = os.open(path + ".new", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token)
        os.replace(path + ".new", path)


def left_key(root: str | None) -> str:
    """The copy token kept in the node's memory directory ("": none). One of another run verifies no fetch."""
    try:
        with open(os.path.join(root or "", TOKEN)) as f:
            return f.read(256).strip()
    except OSError:
        return ""


def left_dirs(root: str | None) -> dict[int, str]:
    """The local ranks' memory directories the node's previous agent left (its ranks: another number than ours)."""
    try:
        names = os.listdir(root or "")
    except OSError:
        return {}
    return {int(n): os.path.join(root or "", n) for n in names if n.isdigit() and len(n) < 6}
