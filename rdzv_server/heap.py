"""Give freed heap memory back to the operating system after finished jobs are forgotten.

glibc's allocator keeps the pages a pruned job's objects freed (fragmentation between long-lived
objects), so untrimmed, a server keeps its peak RSS for good. `malloc_trim(0)` returns the free pages;
it is called once after a burst of pruning (not per job: it walks the whole heap); a no-op off glibc.
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
from collections.abc import Callable

from rdzv_server.core.outbox import Outbox

log = logging.getLogger("rdzv_server.heap")

TRIM_DELAY_S = 5.0        # one trim after a burst of pruning, not one per pruned job


def load_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):        # not glibc (musl, macOS): nothing to call
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


class HeapTrimmer:
    """An effect listener: after jobs are pruned, trim the heap once the burst has passed."""

    def __init__(self, delay_s: float = TRIM_DELAY_S,
                 trim: Callable[[int], int] | None = None) -> None:
        self._trim = trim if trim is not None else load_malloc_trim()
        self._delay_s = delay_s
        self._scheduled: asyncio.TimerHandle | None = None

    def on_effects(self, effects: Outbox) -> None:
        if not effects.pruned or self._trim is None or self._scheduled is not None:
            return
        self._scheduled = asyncio.get_running_loop().call_later(self._delay_s, self.trim_now)

    def trim_now(self) -> None:
        self._scheduled = None
        if self._trim is not None:
            self._trim(0)
            log.debug("heap trimmed after pruning finished jobs")

    def cancel(self) -> None:
        if self._scheduled is not None:
            self._scheduled.cancel()
            self._scheduled = None
