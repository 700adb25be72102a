"""The node's in-memory checkpoint directories: made before the first workers start, kept across their
restarts (one per local rank), removed when the agent ends; node_agent/snapshot.py is the worker's side.
Layout: BASE/node-agent-mem-UID/JOB.PID.XXXXXXXX/LOCAL_RANK, BASE being /dev/shm (memory that outlives the
workers), else the temp directory (a disk: warned). --memory-dir-limit is shared equally by the local ranks.
A SIGKILLed agent cannot clean up, so each run's directory holds an `owner` file (pid and start time), and
every agent starting removes the directories whose owner is gone (pid missing, or reused since).
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable

SHM = "/dev/shm"
RANK_FILE = ".rank"      # in each local rank's directory: the global rank whose snapshots it holds


def default_limit(base: str) -> int:
    """Half of the free space under `base`: room for the snapshots without starving the workers' own use."""
    st = os.statvfs(base)
    return st.f_bavail * st.f_frsize // 2


def _start_time(pid: int) -> str | None:
    """A process's start time in clock ticks since boot (None: no such process, or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]   # field 22; the name in brackets may hold spaces


def _alive(pid: int, started: str) -> bool:
    if os.path.isdir("/proc/self"):
        return _start_time(pid) == started
    try:   # no /proc: the pid alone
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class MemoryDirs:
    def __init__(self, job_id: str, nproc: int, limit: int | None, *, say: Callable[[str], None],
                 base: str | None = None) -> None:
        self.job_id = job_id
        self.nproc = nproc
        self.limit = limit          # bytes for the whole node; None: the default; 0: off
        self._say = say
        self._base = base
        self.root: str | None = None   # this run's JOB.PID directory, once made
        self.rank_limit: int | None = None
        self._failed = False

    @property
    def enabled(self) -> bool:
        return self.limit != 0 and not self._failed

    def dirs(self, local_world_size: int) -> dict[int, str]:
        """local rank -> its directory, made on the first call (empty when switched off or impossible)."""
        if not self.enabled:
            return {}
        try:
            root = self.root or self._open()
            out = {rank: os.path.join(root, str(rank)) for rank in range(local_world_size)}
            for path in out.values():
                os.makedirs(path, mode=0o700, exist_ok=True)
            return out
        except OSError as exc:   # never a failed job over it: the workers run without
            self._failed = True
            self.close()
            self._say(f"no in-memory checkpoint directory ({exc.strerror or exc}); workers run without one")
            return {}

    def dirs_for(self, local_world_size: int, rank_offset: int) -> dict[int, str]:
        """`dirs`, for the round whose local rank 0 is global rank `rank_offset`: a directory whose snapshots were
        saved by another global rank (this node's ranks moved: it closed up, or took a gone node's place) is
        emptied first. A shard of one rank must never be loaded by another (agreed_step then goes to disk)."""
        out = self.dirs(local_world_size)
        moved = []
        for local, path in out.items():
            mark = os.path.join(path, RANK_FILE)
            try:
                with open(mark) as f:
                    held = f.read().strip()
            except OSError:
                held = ""
            if held and held != str(rank_offset + local):
                moved.append(held)
                for name in os.listdir(path):
                    entry = os.path.join(path, name)
                    if name != RANK_FILE and os.path.isdir(entry) and not os.path.islink(entry):
                        shutil.rmtree(entry, ignore_errors=True)     # a folder laid out for a framework's resume
                    elif name != RANK_FILE:
                        with contextlib.suppress(OSError):
                            os.unlink(entry)
            with contextlib.suppress(OSError), open(mark, "w") as f:
                f.write(f"{rank_offset + local}\n")
        if moved:
            self._say(f"this node's ranks moved (now from {rank_offset}): the snapshots of rank(s) {', '.join(moved)} "
                      f"are not theirs and were removed")
        return out

    def _open(self) -> str:
        base = self._base
        if base is None:
            base = SHM if os.path.isdir(SHM) and os.access(SHM, os.W_OK) else tempfile.gettempdir()
            if base != SHM:
                self._say(f"no writable {SHM}: the in-memory checkpoint directory is on disk, under {base}")
        parent = os.path.join(base, f"node-agent-mem-{os.getuid()}")
        os.makedirs(parent, mode=0o700, exist_ok=True)
        removed = sweep(parent)
        if removed:
            self._say(f"removed {removed} in-memory checkpoint director{'y' if removed == 1 else 'ies'} "
                      f"left by agents that were killed")
        limit = self.limit if self.limit is not None else default_limit(base)
        name = re.sub(r"[^A-Za-z0-9_.:@+=~-]", "_", self.job_id)[:200]
        root = tempfile.mkdtemp(prefix=f"{name}.{os.getpid()}.", dir=parent)   # never an earlier run's
        with open(os.path.join(root, "owner"), "w") as f:
            f.write(f"{os.getpid()} {_start_time(os.getpid()) or ''}\n")
        self.root = root
        self.rank_limit = limit // max(1, self.nproc)
        self._say(f"in-memory checkpoints: {root}/LOCAL_RANK, {self.rank_limit / 2**20:.0f} MiB per local rank "
                  f"($NODE_AGENT_MEMORY_DIR)")
        return root

    def close(self) -> None:
        """Remove this run's directories (the job ended, or the node leaves)."""
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None


def sweep(parent: str) -> int:
    """Remove the directories under `parent` whose owning agent is gone (not one being made); how many went."""
    removed = 0
    for entry in os.scandir(parent):
        try:
            with open(os.path.join(entry.path, "owner")) as f:
                pid_text, _, started = f.read().strip().partition(" ")
            pid = int(pid_text)
        except (OSError, ValueError):
            continue   # not ours, or being made right now: leave it
        if not _alive(pid, started):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed += 1
    return removed
