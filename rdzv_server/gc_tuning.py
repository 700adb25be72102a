"""Keep Python's cyclic garbage collector off the server's long-lived state: a full collection walks every
tracked object (millions on a large server) and stalls the loop, typically in a round change's burst.
- `tune_gc`, at start-up: freeze everything alive (`gc.freeze`) and make young collections rarer.
- `Freezer`: every TICK_S a young collection, then its survivors frozen, so each object is walked at
  most once while young. Collect before freezing, or cyclic garbage is frozen (kept) too; do not wait
  for CPython's own collections: its young count falls with every object freed, so they may not come.
- A frozen object that joins a garbage cycle is not reclaimed while frozen, so every REFRESH_S all is
  unfrozen and collected once (one full walk, its time logged), then frozen again; sooner (at most every
  EARLY_REFRESH_S) once the frozen objects have doubled since the last walk: a flood of connections that each
  lived past a tick leaves their cycles frozen, and an hour of them is memory an attacker chooses (a review:
  280-480 MB after 180k connections). A walk per doubling costs each object O(1) walks, amortised.
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
EARLY_REFRESH_S = 60.0          # ... or this long after the last, once the frozen objects doubled
EARLY_REFRESH_FLOOR = 200_000   # (grew by at least this many: a small server's few objects need no walk)


def tune_gc() -> None:
    """At start-up: freeze what is alive, and make young collections rarer."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD_0, 20, 20)


class Freezer:
    """Every tick a young collection and its survivors frozen; every `refresh_s` a full one (all unfrozen)."""

    def __init__(self, refresh_s: float = REFRESH_S, clock: Callable[[], float] = time.monotonic,
                 frozen: Callable[[], int] = gc.get_freeze_count) -> None:
        self.refresh_s = refresh_s
        self._clock = clock
        self._frozen = frozen
        self._refreshed_at = clock()
        self._frozen_after = frozen()        # frozen objects after the last full walk
        self._task: asyncio.Task[None] | None = None

    def _refresh_due(self) -> str:
        since = self._clock() - self._refreshed_at
        if since >= self.refresh_s:
            return "hourly"
        if since >= EARLY_REFRESH_S and self._frozen() >= max(2 * self._frozen_after,
                                                               self._frozen_after + EARLY_REFRESH_FLOOR):
            return "early (the frozen objects doubled)"
        return ""

    def tick(self) -> None:
        """A refresh when due, else a young collection; then the survivors frozen (O(1): lists moved)."""
        if why := self._refresh_due():
            self._refreshed_at = self._clock()
            started = time.perf_counter()
            gc.unfreeze()
            freed = gc.collect()
            log.info("garbage collector: the %s full collection took %.2fs and freed %d objects",
                     why, time.perf_counter() - started, freed)
            gc.freeze()
            self._frozen_after = self._frozen()
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
