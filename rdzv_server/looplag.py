"""How late the event loop runs a timer: the measure of a stalled loop (e.g. by disk writes)."""
from __future__ import annotations

import asyncio
import time

INTERVAL_S = 0.05


class LoopLagProbe:
    """Wakes every INTERVAL_S and records how much later than asked it woke."""

    def __init__(self) -> None:
        self.samples = 0
        self.max_s = 0.0
        self.total_s = 0.0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="rdzv-loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(INTERVAL_S)      # the measurement itself, not a synchronisation wait
            lag = max(0.0, time.perf_counter() - t0 - INTERVAL_S)
            self.samples += 1
            self.total_s += lag
            self.max_s = max(self.max_s, lag)

    def summary(self) -> str:
        mean = self.total_s / self.samples if self.samples else 0.0
        return f"event loop lag max {self.max_s * 1000:.1f} ms, mean {mean * 1000:.2f} ms over {self.samples} samples"
