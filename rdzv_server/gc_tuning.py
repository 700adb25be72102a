"""Keep Python's cyclic garbage collector off the server's long-lived state.

A full collection walks every object the collector tracks. A server holding 10,000 streams tracks
millions (each connection's aiohttp objects, each node's records), so a full collection stalls the
loop for 20-110 ms, and it tends to come in the middle of an allocation burst: a round change,
just when a failure report waits for its reply (docs/benchmarks.md, "Pushed rounds").
- At start-up, everything alive (modules, the app, the state restored from the store) is moved out
  of the collector's view (`gc.freeze`), and young collections run less often (`tune_gc`).
- After that, `Freezer` runs a young collection every TICK_S and freezes what survived it: each
  object is walked at most once while young, in slices of a tenth of a second's allocations, and
  then never again. Two earlier rules failed:
  - freezing only after CPython's own collections: its young count falls with every object freed,
    old or young, so while the polls held at 10,000 nodes (58 tracked objects each) were answered
    and sent again no collection ran, and the first one after a round change walked 580,000 young
    objects in 0.4-0.9 s, just as the report waited for its reply;
  - freezing whatever was alive each second without collecting first: that froze cyclic garbage
    too, kept until the hourly refresh, and hostile requests make some (`make fuzz`, 30,000
    requests: server RSS 49 -> 283 MB, against 85 MB with a collection before each freeze).
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
TICK_S = 0.1          # a young collection and a freeze this often
REFRESH_S = 3600.0    # one full walk an hour (its time is logged: it grows with the fleet)


def tune_gc() -> None:
    """At start-up: freeze what is alive, and make young collections rarer."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD_0, 20, 20)


class Freezer:
    """Collects the young generation and freezes its survivors every tick; unfreezes and collects
    everything once every `refresh_s`."""

    def __init__(self, refresh_s: float = REFRESH_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.refresh_s = refresh_s
        self._clock = clock
        self._refreshed_at = clock()
        self.freezes = 0
        self.refreshes = 0
        self._task: asyncio.Task[None] | None = None

    def tick(self) -> None:
        """A refresh when due, else a young collection; then the survivors frozen (O(1): lists moved)."""
        if self._clock() - self._refreshed_at >= self.refresh_s:
            self._refreshed_at = self._clock()
            started = time.perf_counter()
            gc.unfreeze()
            freed = gc.collect()
            self.refreshes += 1
            log.info("garbage collector: the hourly full collection took %.2fs and freed %d objects",
                     time.perf_counter() - started, freed)
        else:
            gc.collect(0)     # garbage must not be frozen: only what survives a collection is
        gc.freeze()
        self.freezes += 1

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
