"""Keep Python's cyclic garbage collector off the server's long-lived state.

A full collection walks every object the collector tracks. A server holding 10,000 streams tracks
millions (each connection's aiohttp objects, each node's records), so a full collection stalls the
loop for 20-110 ms, and it tends to come in the middle of an allocation burst: a round change,
just when a failure report waits for its reply (docs/benchmarks.md, "Pushed rounds").
- At start-up, everything alive (modules, the app, the state restored from the store) is moved out
  of the collector's view (`gc.freeze`), and young collections run less often (`tune_gc`).
- After that, `Freezer` freezes what survived the collections of the last CHECK_S (if any ran):
  every collection then walks only what came since, whatever the fleet. Without it, what a round
  change or a join storm left alive sits in the middle generation, and each of its collections
  walked it all again (117-146 ms at 10,000 streams, measured); this server makes almost no cyclic
  garbage (0-18 objects a collection), so freezing costs it next to nothing.
- A frozen object that later becomes part of a garbage cycle is not reclaimed while frozen, so
  every REFRESH_S everything is unfrozen and collected once (one full walk, logged with its time),
  then frozen again. CPython would make such full walks on its own anyway, whenever the long-lived
  objects grew by a quarter.
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
CHECK_S = 1.0
REFRESH_S = 3600.0    # one full walk an hour (its time is logged: it grows with the fleet)


def tune_gc() -> None:
    """At start-up: freeze what is alive, and make young collections rarer."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD_0, 20, 20)


def collections() -> int:
    """Collections of any generation so far (CPython counts each under the oldest it walked)."""
    return sum(int(g["collections"]) for g in gc.get_stats())


class Freezer:
    """Freezes what survived the latest collections; unfreezes and collects once every `refresh_s`."""

    def __init__(self, refresh_s: float = REFRESH_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.refresh_s = refresh_s
        self._clock = clock
        self._seen = collections()
        self._refreshed_at = clock()
        self.freezes = 0
        self.refreshes = 0
        self._task: asyncio.Task[None] | None = None

    def tick(self) -> None:
        """One check: a collection since the last one freezes its survivors; a refresh when due."""
        if self._clock() - self._refreshed_at >= self.refresh_s:
            self._refreshed_at = self._clock()
            started = time.perf_counter()
            gc.unfreeze()
            freed = gc.collect()
            self.refreshes += 1
            log.info("garbage collector: the hourly full collection took %.2fs and freed %d objects",
                     time.perf_counter() - started, freed)
        elif collections() == self._seen:
            return
        gc.freeze()
        self._seen = collections()
        self.freezes += 1

    def start(self, every_s: float = CHECK_S) -> None:
        self._task = asyncio.create_task(self._run(every_s), name="rdzv-gc-freezer")

    async def _run(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)     # a period, not a wait for an event
            self.tick()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
