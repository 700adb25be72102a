"""The heap trimmer runs once after a burst of pruning, and never for effects without pruning."""
from __future__ import annotations

import asyncio

import pytest

from rdzv_server.core.outbox import Outbox
from rdzv_server.heap import HeapTrimmer


@pytest.mark.asyncio
async def test_one_trim_after_a_burst_of_pruning() -> None:
    trimmer = HeapTrimmer(delay_s=0.0)
    assert trimmer._trim is not None, "glibc's malloc_trim should be found on this Linux"
    trimmer.on_effects(Outbox())                      # nothing pruned: nothing scheduled
    assert trimmer._scheduled is None
    for i in range(100):
        trimmer.on_effects(Outbox(pruned={f"job-{i}"}))
    assert trimmer._scheduled is not None
    done = asyncio.Event()
    asyncio.get_running_loop().call_later(0.0, done.set)   # runs after the trim (same deadline, FIFO)
    await done.wait()
    assert trimmer.trims == 1
    trimmer.on_effects(Outbox(pruned={"again"}))
    trimmer.cancel()
    assert trimmer._scheduled is None and trimmer.trims == 1
