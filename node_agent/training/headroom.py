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
import re
import threading
import time
from collections.abc import Callable, Collection

LOCAL_RANKS_VAR = "LOCAL_WORLD_SIZE"
FS_RESERVE = 0.25      # of the file system left to others, as the copy store leaves (copies/room.py)
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


SIBLINGS_WAIT_S = 10.0    # the most the last one stays for the node's other ranks (one whose write failed)
SIBLINGS_LOOK_S = 0.01
_STEP = re.compile(r"step-(\d{1,18})")


def await_siblings(step: int, where: str, stop: threading.Event | None = None, wait_s: float | None = None) -> bool:
    """Until every other local rank of the node that holds a snapshot (in the directories beside `where`: the
    agent's ROOT/LOCAL_RANK) holds `step` or a newer one: True; False where `stop` came first, or `wait_s` passed
    with one still behind (its write failed: the one kept beside stays for the next snapshot's keep rule)."""
    deadline = time.monotonic() + (SIBLINGS_WAIT_S if wait_s is None else wait_s)
    while siblings_behind(step, where):
        if time.monotonic() >= deadline:
            return False
        if stop is not None:
            if stop.wait(SIBLINGS_LOOK_S):
                return False
        else:
            time.sleep(SIBLINGS_LOOK_S)
    return True


def siblings_behind(step: int, where: str) -> bool:
    """Whether another local rank of the node that holds a snapshot holds none of `step` or later."""
    parent, me = os.path.split(os.path.normpath(where))
    if not me.isdigit():
        return False                    # not an agent's rank directory: no siblings known
    return any(_behind(os.path.join(parent, str(r)), step) for r in range(_local_ranks()) if str(r) != me)


_waits: dict[str, tuple[threading.Thread, threading.Event]] = {}     # a rank directory -> its drop's wait


def drop_after_siblings(step: int, where: str, paths: list[str], drop: Callable[[str], None]) -> None:
    """`drop` each of `paths` (the snapshot kept beside `step`'s) once the node's other ranks hold `step` too, so
    none of them is left without a step the others hold (a review: ranks that finished at different times held
    none in common 5% of the time): now where they do, else in a thread of its own, which `supersede` ends."""
    supersede(where)
    if not paths or not siblings_behind(step, where):
        for p in paths:
            drop(p)
        return
    stop = threading.Event()

    def later() -> None:
        if await_siblings(step, where, stop):
            for p in paths:
                drop(p)
    thread = threading.Thread(target=later, daemon=True, name=f"node-agent snapshot {step}: the one before")
    _waits[where] = (thread, stop)
    thread.start()           # (a daemon: an exit leaves what it waits to drop, a step the node's ranks hold)


def supersede(where: str) -> None:
    """The next snapshot of `where` begins: the wait of the last one's drop ends, and what it would drop is left to
    the new one's keep rule (`fit` keeps the newest step the other ranks hold too). Called before the keep rule
    looks, so no file goes from under it."""
    waiting = _waits.pop(where, None)
    if waiting is not None:
        waiting[1].set()
        waiting[0].join()


def _behind(directory: str, step: int) -> bool:
    try:
        held = [int(m[1]) for name in os.listdir(directory) if (m := _STEP.fullmatch(name))]
    except OSError:
        return False
    return bool(held) and max(held) < step       # (one that holds none takes no snapshots: not waited for)


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
