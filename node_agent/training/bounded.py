"""A snapshot's file while it is written (snapshot.save): it refuses to grow past the memory directory's limit or
what /dev/shm has left, and says so as MemoryDirFull, whatever the writer does with the refusal. No torch import."""
from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator
from typing import BinaryIO

FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)    # no room for the snapshot: MemoryDirFull, as past the limit


class MemoryDirFull(OSError):
    """A snapshot does not fit the memory directory's limit (or /dev/shm is full)."""


class Bounded:
    """A file that refuses to grow past `room` bytes, or past what its file system has left (ENOSPC), then drops
    later writes: a writer's clean-up (torch.save finishing its zip) must not hide the first refusal (a review:
    torch's zip writer turned a full /dev/shm into a RuntimeError, and the worker died at every save)."""

    def __init__(self, f: BinaryIO, room: int | None) -> None:
        self._f = f
        self._room = room
        self.written = 0
        self.full = False

    def write(self, data: bytes) -> int:
        if self.full:
            return len(data)
        if self._room is not None and self.written + len(data) > self._room:
            self.full = True
            raise MemoryDirFull(f"needs more than the {self._room} bytes left")
        with self._no_space():
            done = self._f.write(data)
        self.written += len(data)
        return done

    @contextlib.contextmanager
    def _no_space(self) -> Iterator[None]:
        """ENOSPC from a write, or from the buffered file's flush of earlier ones: the file system is full."""
        try:
            yield
        except OSError as exc:
            if exc.errno in FULL:
                self.full = True
            raise

    def flush(self) -> None:
        with self._no_space():
            self._f.flush()

    def tell(self) -> int:
        return self._f.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        with self._no_space():
            return self._f.seek(offset, whence)

    def seekable(self) -> bool:
        return True
