"""The snapshot files a capture writes, mapped (capture.py): each kept open and mapped while it may be written
over in place, and what tells whether a name is still that file."""
from __future__ import annotations

import contextlib
import mmap
import os
import time
from dataclasses import dataclass

import torch

POPULATE = getattr(mmap, "MAP_POPULATE", 0)     # Linux


@dataclass
class Slab:
    """A snapshot file this process wrote, mapped shared: its data region is written again in place. Its
    descriptor stays open: the inode cannot be freed and its number given to another file meanwhile, so a name
    with this inode number is this file."""
    fd: int
    ino: int
    size: int          # the data region's size: the mapping's
    region: torch.Tensor

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def touch(name: str) -> None:
    """A new modification time, before a byte changes: a sender of the file's bytes (copies/files.names) sees it
    was written over, even where this process's mapping writes it with no fault (and so no time of its own)."""
    st = os.stat(name)
    os.utime(name, ns=(st.st_atime_ns, max(time.time_ns(), st.st_mtime_ns + 1)))


def stat(name: str) -> os.stat_result | None:
    """Its status, or None where the name is gone."""
    try:
        return os.stat(name)
    except OSError:
        return None


def inode(name: str) -> int:
    try:
        return os.stat(name).st_ino
    except OSError:
        return -1

