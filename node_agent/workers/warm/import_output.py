"""What the preloads' imports print, as a cold worker would show it: on each worker's own stdout and stderr.
Loaded by the zygote from its own folder (it imports only the standard library, never node_agent)."""
from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Callable

REPEATED_LIMIT = 1 << 20   # bytes of each stream's import-time output every warm worker repeats


def printed_by(run: Callable[[], None]) -> tuple[bytes, bytes]:
    """Run `run` with the zygote's stdout and stderr in memory files; returns what each got. A cold worker prints
    what its imports print on its own streams, so each warm worker repeats it there (repeat), where it would
    otherwise reach the agent's stderr once, or nowhere. Without descriptors for the files: as that."""
    fds: list[int] = []
    try:
        fds.append(os.memfd_create("stdout"))
        fds.append(os.memfd_create("stderr"))
        fds.append(os.dup(1))
        fds.append(os.dup(2))
    except (OSError, AttributeError):
        for fd in fds:
            os.close(fd)
        run()
        return b"", b""
    out, err, saved_out, saved_err = fds
    try:
        os.dup2(out, 1)
        os.dup2(err, 2)
        run()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        with contextlib.suppress(Exception):
            ctypes.CDLL(None).fflush(None)          # C's own stdio buffer (an extension's printf)
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
    printed = _bounded(out), _bounded(err)
    for fd in fds:
        os.close(fd)
    return printed


def _bounded(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    data = os.pread(fd, REPEATED_LIMIT, 0)
    if size > REPEATED_LIMIT:
        data += f"\n[node-agent: {size - REPEATED_LIMIT} more bytes printed by the preloads' imports are not " \
                f"repeated here]\n".encode()
    return data


def repeat(printed: tuple[bytes, bytes]) -> None:
    """What the preloads' imports printed, onto the worker's own stdout and stderr (printed_by)."""
    for fd, data in zip((1, 2), printed, strict=True):
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(fd, view):]
            except OSError:     # a closed console: the worker's own prints would fail there too
                break
