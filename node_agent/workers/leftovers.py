"""multiprocessing's `pymp-*` temp directories (sockets of DataLoader workers, Managers, forkservers) that
killed workers leave behind: only a process that exits by itself removes its own. So before a stop signals
the groups, the agent notes the ones their processes hold a socket in (/proc/net/unix, /proc/PID/fd) and
removes those still there once the groups are gone. Linux only; elsewhere nothing is noted.
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Collection

PREFIX = "pymp-"       # multiprocessing.util.get_temp_dir's directories


def held_temp_dirs(groups: Collection[int], proc: str = "/proc") -> set[str]:
    """The `pymp-*` directories in which processes of the process groups `groups` hold a Unix socket."""
    if not groups:
        return set()
    # The sockets first (one read): most jobs have none there and need no scan of /proc.
    candidates = {inode: d for inode, path in _unix_sockets(f"{proc}/net/unix") if (d := _pymp_dir(path))}
    if not candidates:
        return set()
    inodes: set[str] = set()
    try:
        pids = [name for name in os.listdir(proc) if name.isdigit()]
    except OSError:
        return set()
    for pid in pids:
        if _group_of(f"{proc}/{pid}/stat") not in groups:
            continue
        try:
            fds = os.listdir(f"{proc}/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"{proc}/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    return {d for inode, d in candidates.items() if inode in inodes}


def remove(dirs: Collection[str]) -> None:
    for path in dirs:
        shutil.rmtree(path, ignore_errors=True)


def _group_of(stat_path: str) -> int:
    try:
        with open(stat_path, "rb") as f:
            stat = f.read()
    except OSError:
        return -1
    # "PID (COMM) STATE PPID PGRP ...": COMM may hold spaces and parentheses; the last ')' ends it
    fields = stat[stat.rfind(b")") + 2:].split()
    return int(fields[2]) if len(fields) > 2 else -1


def _unix_sockets(path: str) -> list[tuple[str, str]]:
    """(inode, path) of every bound Unix socket (/proc/net/unix: Num RefCount Protocol Flags Type St Inode Path)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()[1:]
    except OSError:
        return []
    rows = [line.split(None, 7) for line in lines]
    return [(cols[6], cols[7]) for cols in rows if len(cols) == 8 and cols[7].startswith("/")]


def _pymp_dir(socket_path: str) -> str | None:
    """The `pymp-*` directory a socket lies in, directly (multiprocessing's layout: DIR/pymp-X/listener-Y)."""
    parent = os.path.dirname(socket_path)
    return parent if os.path.basename(parent).startswith(PREFIX) else None
