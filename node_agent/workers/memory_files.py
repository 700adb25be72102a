"""What a node's memory directory (workers/memory.py) holds: counted, for its limit, and removed."""
from __future__ import annotations

import contextlib
import os
import shutil


def default_limit(base: str, held: int = 0) -> int:
    """Half of the free space under `base` and of the `held` bytes this node's directory takes up already (its
    previous agent's snapshots and the copies it held: a review saw each restart halve what the node could keep,
    until no snapshot fit and every rank went back to step 0): room for the snapshots without starving the
    workers' own use."""
    st = os.statvfs(base)
    return (st.f_bavail * st.f_frsize + held) // 2


def bytes_under(path: str) -> int:
    """What the files under `path` take up (their blocks: a sparse file counts what it uses)."""
    total = 0
    for where, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(where, name), follow_symlinks=False).st_blocks * 512
    return total


def empty(path: str, keep: set[str]) -> None:
    """Remove everything in `path` but the files named in `keep`."""
    for name in os.listdir(path):
        entry = os.path.join(path, name)
        if name in keep:
            continue
        if os.path.isdir(entry) and not os.path.islink(entry):
            shutil.rmtree(entry, ignore_errors=True)     # a rank's directory, a framework's resume folder
        else:
            with contextlib.suppress(OSError):
                os.unlink(entry)
