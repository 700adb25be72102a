"""Keep Python's cyclic garbage collector off the server's long-lived state: a full collection walks every
tracked object (millions on a large server) and stalls the loop, typically in a round change's burst.
- `tune_gc`, at start-up: freeze everything alive (`gc.freeze`) and make young collections rarer.
- `Freezer`: every TICK_S a young collection, then its survivors frozen, so each object is walked at
  most once while young. Collect before freezing, or cyclic garbage is frozen (kept) too; do not wait
  for CPython's own collections: its young count falls with every object freed, so they may not come.
- A frozen object that joins a garbage cycle is not reclaimed while frozen, so every REFRESH_S all is
  unfrozen and collected once (one full walk, its time logged), then frozen again.
Objects freed by their reference count (most of them) are freed at once, frozen or not.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable

log = logging.getLogger("rdzv_server")

GC_THRESHOLD_0 = 20_000       # allocations between young collections (CPython's default: 700)
TICK_S = 0.1          # a young collection and a freeze this often
REFRESH_S = 3600.0    # one full walk an hour (its time is logged: it grows with the fleet)


def tune_gc() -> None:
    """At start-up: freeze what is alive, and make young collections rarer."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD_0, 20, 20)


class Freezer:
    """Every tick a young collection and its survivors frozen; every `refresh_s` a full one (all unfrozen)."""

    def __init__(self, refresh_s: float = REFRESH_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.refresh_s = refresh_s
        self._clock = clock
        self._refreshed_at = clock()
        self._task: asyncio.Task[None] | None = None

    def tick(self) -> None:
        """A refresh when due, else a young collection; then the survivors frozen (O(1): lists moved)."""
        if self._clock() - self._refreshed_at >= self.refresh_s:
            self._refreshed_at = self._clock()
            started = time.perf_counter()
            gc.unfreeze()
            freed = gc.collect()
            log.info("garbage collector: the hourly full collection took %.2fs and freed %d objects",
                     time.perf_counter() - started, freed)
        else:
            gc.collect(0)     # garbage must not be frozen: only what survives a collection is
        gc.freeze()

    def start(self, every_s: float = TICK_S) -> None:
        self._task = asyncio.create_task(self._run(every_s), name="rdzv-gc-freezer")

    async def _run(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)     # a period, not a wait for an event
            self.tick()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
