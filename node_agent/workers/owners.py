"""Which agent owns a directory it made in shared memory (its memory directories, its probes' records), so that
a SIGKILLed agent's directories are told from a live one's. The directory's `owner` file names the agent (pid and
start time) and is flock'ed for as long as the agent lives: the kernel drops the lock with the process, so there is
no window in which two agents think they own one directory. An owner file nobody locks (an older agent's) is
judged by its pid and start time alone."""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass

OWNER = "owner"
# Directories claimed for this agent ahead of their use (workers/succession.py: before its node id was final), by
# path, for the MemoryDirs that opens them
claimed_ahead: dict[str, Ownership] = {}


def start_time(pid: int) -> str | None:
    """A process's start time in clock ticks since boot (None: no such process, or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]   # field 22; the name in brackets may hold spaces


def alive(pid: int, started: str) -> bool:
    """Whether process `pid`, started at `started` (start_time), still runs (a reused pid is another process; a
    zombie, ended and not yet reaped by its parent, runs no more)."""
    if os.path.isdir("/proc/self"):
        return start_time(pid) == started and not _zombie(pid)
    return _running(pid)    # no /proc: the pid alone


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


def _read(fd: int) -> tuple[int, str] | None:
    """(pid, start time) an owner file names, or None when it names none."""
    pid_text, _, started = os.pread(fd, 128, 0).decode("ascii", "replace").strip().partition(" ")
    return (int(pid_text), started) if pid_text.isdigit() else None


@dataclass
class Ownership:
    """This agent's hold on a directory: its owner file, open and locked until `release` or the agent's end."""
    directory: str
    fd: int
    previous: int | None       # the pid of the agent that owned it before (None: made by this one)

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.fd = -1


SWEEP_WAIT_S = 3.0      # longest a claim waits out another agent's look at a gone owner's directory (owner_gone)
SWEEP_PAUSE_S = 0.05


def claim(directory: str, pause: Callable[[float], None] = time.sleep) -> Ownership | None:
    """Own `directory` (it exists): lock its owner file, made when missing, and write this process into it. None when a
    live agent owns it, or it was removed meanwhile (a sweep of another agent)."""
    path = os.path.join(directory, OWNER)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except FileNotFoundError:
        return None
    try:
        _lock(fd, pause)
        before = _read(fd)
        if before is not None and before[0] != os.getpid() and alive(*before):
            raise BlockingIOError       # an older agent, which holds no lock, but lives
        if os.fstat(fd).st_ino != os.stat(path).st_ino:
            raise FileNotFoundError     # removed by a sweep between our open and our lock
    except OSError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {start_time(os.getpid()) or ''}\n".encode("ascii"), 0)
    return Ownership(directory, fd, before[0] if before is not None and before[0] != os.getpid() else None)


def _lock(fd: int, pause: Callable[[float], None]) -> None:
    """Lock an owner file. Held while it names a gone agent: another agent's sweep (owner_gone) is looking at the
    directory, for a moment; wait it out, up to SWEEP_WAIT_S (a review: a killed node's next agent, started as
    another agent swept, took the lock for a live agent's and made a directory of its own: its snapshots lost)."""
    waited = 0.0
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            named = _read(fd)
            if named is None or named[0] == os.getpid() or alive(*named) or waited >= SWEEP_WAIT_S:
                raise
        pause(SWEEP_PAUSE_S)
        waited += SWEEP_PAUSE_S


def owner_gone(directory: str) -> Ownership | None:
    """The hold on `directory` when the agent that owned it is gone (for its remover to release once it is removed),
    else None: its owner lives, or it has no owner file yet (being made), or one that names no process (not ours)."""
    path = os.path.join(directory, OWNER)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        before = _read(fd)
        if before is None or alive(*before):
            raise BlockingIOError
    except (OSError, ValueError):
        os.close(fd)
        return None
    return Ownership(directory, fd, before[0])


def live_owner(directory: str) -> int | None:
    """The pid of the live agent that owns `directory` (its lock held, or an older agent's pid alive), else None: no
    owner file, one nobody holds, or it names no process."""
    try:
        fd = os.open(os.path.join(directory, OWNER), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        named = _read(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return named[0] if named is not None else -1      # locked: its owner lives
        return named[0] if named is not None and named[0] != os.getpid() and alive(*named) else None
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def sweep(parent: str, prefix: str) -> int:
    """Remove the directories `parent/PREFIX<pid>.*` whose agent is gone: by their owner file, or, made by an agent
    that wrote none (an older one), by the pid in their name. How many went."""
    removed = 0
    try:
        entries = [e for e in os.scandir(parent) if e.name.startswith(prefix) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return 0
    for entry in entries:
        gone = owner_gone(entry.path)
        pid = entry.name[len(prefix):].partition(".")[0]
        if gone is None and (os.path.exists(os.path.join(entry.path, OWNER)) or not pid.isdigit()
                             or _running(int(pid))):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed += 1
        if gone is not None:
            gone.release()
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
