"""Whether a snapshot can be written beside the last complete one for the write's time, past the memory
directory's limit (snapshot.fit: a limit that holds one snapshot would otherwise drop it first, and a node killed
during the write would leave the rank none): only where the file system and the memory both have room for it,
for every local rank of the node at once (they write the same step together), and a reserve stays free after it.
A tmpfs's pages are memory, and a container's memory limit counts them: a write the file system takes could still
get the node OOM-killed, and the training's own memory peaks while the write runs in the background (a review: a
snapshot kept beside past the limit at rest got a worker OOM-killed at its next allocation). No torch import (the
agent may import the snapshot module)."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Collection

LOCAL_RANKS_VAR = "LOCAL_WORLD_SIZE"
FS_RESERVE = 0.25      # of /dev/shm past-limit snapshots and peer copies leave free (copies/room.py): workers need some
MEMORY_RESERVE = 0.10  # of the memory (the machine's, each cgroup's limit) left to the training's peaks


def room_beside(where: str, new: int, freed: int = 0) -> bool:
    """Room for `new` more bytes a local rank (less `freed`: what its own drops give back) with the reserves left
    (a review: /dev/shm was held at 9 MB free, a peer's copy refused, another program's write failed)."""
    need = max(0, new - freed) * _local_ranks()
    try:
        st = os.statvfs(where)
    except OSError:
        return False
    if st.f_bavail * st.f_frsize - need < FS_RESERVE * st.f_blocks * st.f_frsize:
        return False
    return all(free - need >= MEMORY_RESERVE * total for free, total in memory_room())


def freed_by(paths: list[str], own: Collection[int] = ()) -> int:
    """Bytes removing `paths` gives back: not a file with another name (a hard link: the agent's while it sends
    it), nor one this process maps (a restore's tensors lie in their snapshot's mapping), but for `own`: the
    inodes a capture maps and unmaps as it drops them."""
    mapped = mapped_inodes()
    out = 0
    for p in paths:
        with contextlib.suppress(OSError):
            st = os.stat(p)
            if st.st_nlink == 1 and mapped is not None and (st.st_ino not in mapped or st.st_ino in own):
                out += st.st_size
    return out


def mapped_inodes() -> set[int] | None:
    """The inodes of the files this process maps, or None where it cannot tell."""
    try:
        with open("/proc/self/maps") as f:
            return {int(fields[4]) for line in f if len(fields := line.split(maxsplit=5)) >= 5 and fields[4] != "0"}
    except (OSError, ValueError):
        return None


def _local_ranks() -> int:
    try:
        return max(1, min(1024, int(os.environ.get(LOCAL_RANKS_VAR, "1"))))
    except ValueError:
        return 1


def memory_room() -> list[tuple[int, int]]:
    """(bytes free, bytes in all) of each bound on this process's memory: the kernel's MemAvailable of MemTotal,
    and each memory cgroup it is in, or above it (a Slurm step's, a pod's), that is limited (cgroup v2's
    memory.max and memory.high, or v1's memory.limit_in_bytes, less what is used); empty where none can be read."""
    found: dict[str, int] = {}
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("MemAvailable", "MemTotal"):
                found[key] = int(rest.split()[0]) * 1024
    out = [(found["MemAvailable"], found["MemTotal"])] if len(found) == 2 else []
    return out + [(most - used, most) for most, used in cgroup_limits()]


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
