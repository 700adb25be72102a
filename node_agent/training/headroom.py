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
    """Bytes of memory this process's processes may still take: the kernel's MemAvailable, less where a memory
    cgroup it is in, or any group above it (a Slurm step's, a pod's), is limited to less (cgroup v2's memory.max
    and memory.high, or v1's memory.limit_in_bytes, less what is used); None where none can be read."""
    found: list[int] = []
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
                break
    found += [most - used for most, used in cgroup_limits()]
    return min(found) if found else None


V2 = (("/sys/fs/cgroup", "/sys/fs/cgroup/unified"), ("memory.max", "memory.high"), "memory.current")
V1 = (("/sys/fs/cgroup/memory",), ("memory.limit_in_bytes",), "memory.usage_in_bytes")
NO_LIMIT = 1 << 60         # v1 says "no limit" with a number near 2**63


def cgroup_limits(groups: str = "/proc/self/cgroup", v2: tuple[tuple[str, ...], tuple[str, ...], str] = V2,
                  v1: tuple[tuple[str, ...], tuple[str, ...], str] = V1) -> list[tuple[int, int]]:
    """(limit, usage) of each memory cgroup this process is in and of each above it, as far as they are mounted."""
    out: list[tuple[int, int]] = []
    with contextlib.suppress(OSError):
        with open(groups) as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
        for fields in lines:
            if len(fields) != 3:
                continue
            kind = v2 if fields[0] == "0" and not fields[1] else v1 if "memory" in fields[1].split(",") else None
            if kind is not None:
                out += _limits_up(fields[2], *kind)
    return out


def _limits_up(group: str, roots: tuple[str, ...], limits: tuple[str, ...], usage: str) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for root in roots:
        where = os.path.join(root, group.lstrip("/"))
        while True:
            used = _number(os.path.join(where, usage))
            for name in limits:
                most = _number(os.path.join(where, name))
                if most is not None and used is not None and most < NO_LIMIT:
                    out.append((most, used))
            if os.path.normpath(where) == os.path.normpath(root):
                break
            where = os.path.dirname(where)
    return out


def _number(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):       # "max": no limit; a file not there
        return None
