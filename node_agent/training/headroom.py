"""Whether a snapshot can be written beside the last complete one for the write's time, past the memory
directory's limit (snapshot.fit: a limit that holds one snapshot would otherwise drop it first, and a node killed
during the write would leave the rank none): only where the file system and the memory both have room for it,
for every local rank of the node at once (they write the same step together). A tmpfs's pages are memory, and a
container's memory limit counts them: a write the file system takes could still get the node OOM-killed.
No torch import (the agent may import the snapshot module)."""
from __future__ import annotations

import contextlib
import os

LOCAL_RANKS_VAR = "LOCAL_WORLD_SIZE"


def room_beside(where: str, new: int) -> bool:
    need = new * _local_ranks()
    try:
        st = os.statvfs(where)
    except OSError:
        return False
    if st.f_bavail * st.f_frsize < need:
        return False
    free = free_memory()
    return free is None or free >= need


def _local_ranks() -> int:
    try:
        return max(1, min(1024, int(os.environ.get(LOCAL_RANKS_VAR, "1"))))
    except ValueError:
        return 1


def free_memory() -> int | None:
    """Bytes of memory this process's processes may still take: the kernel's MemAvailable, less where its
    cgroup (v2) is limited to less; None where neither can be read."""
    found: list[int] = []
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
                break
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/cgroup") as f:
            group = next((line.strip()[3:] for line in f if line.startswith("0::")), None)
        if group is not None:
            base = os.path.join("/sys/fs/cgroup", group.lstrip("/"))
            with open(os.path.join(base, "memory.max")) as f:
                most = f.read().strip()
            if most != "max":
                with open(os.path.join(base, "memory.current")) as f:
                    found.append(int(most) - int(f.read().strip()))
    return min(found) if found else None
