"""The heap trimmer runs once after a burst of pruning, and never for effects without pruning."""
from __future__ import annotations

import asyncio

import pytest

from rdzv_server.core.outbox import Outbox
from rdzv_server.heap import HeapTrimmer, load_malloc_trim


def test_glibc_malloc_trim_is_found_on_this_linux() -> None:
    trim = load_malloc_trim()
    assert trim is not None and trim(0) in (0, 1)


@pytest.mark.asyncio
async def test_one_trim_after_a_burst_of_pruning() -> None:
    trims: list[int] = []
    trimmer = HeapTrimmer(delay_s=0.0, trim=lambda pad: trims.append(pad) or 1)
    trimmer.on_effects(Outbox())                      # nothing pruned: nothing scheduled
    await _after_due_timers()
    assert trims == []
    for i in range(100):
        trimmer.on_effects(Outbox(pruned={f"job-{i}"}))
    await _after_due_timers()
    assert trims == [0]
    trimmer.on_effects(Outbox(pruned={"again"}))
    trimmer.cancel()                                  # a cancelled trim does not run
    await _after_due_timers()
    assert trims == [0]


async def _after_due_timers() -> None:
    """Returns once timers due now have run (same deadline: first in, first run)."""
    done = asyncio.Event()
    asyncio.get_running_loop().call_later(0.0, done.set)
    await done.wait()
