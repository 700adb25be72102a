"""StreamHub's fan-out pacing: wakes that come while a flush would start too soon after the last one
coalesce into one flush, scheduled FLUSH_GAP times the last flush's duration after it ended."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from rdzv_server.streams import StreamHub


class RecordingHub(StreamHub):
    def __init__(self) -> None:
        super().__init__(SimpleNamespace(waiters=SimpleNamespace(listeners=[])))   # type: ignore[arg-type]
        self.flushed: list[set[str]] = []

    def _flush_jobs(self, dirty: set[str]) -> None:
        self.flushed.append(set(dirty))


async def test_wakes_inside_the_gap_after_a_flush_coalesce_into_one_later_flush(monkeypatch) -> None:
    hub = RecordingHub()
    hub._by_job = {"a": set(), "b": set()}
    loop = asyncio.get_running_loop()
    scheduled: list[tuple[float, object]] = []
    monkeypatch.setattr(loop, "call_later", lambda delay, callback: scheduled.append((delay, callback)))

    hub.wake("a")                       # nothing flushed before: at once (call_soon)
    await asyncio.sleep(0)
    assert hub.flushed == [{"a"}] and scheduled == []

    hub._next_flush_at = loop.time() + 100.0      # as if that flush had taken 50 s
    for job in ("a", "b", "a"):
        hub.wake(job)
        await asyncio.sleep(0)
    assert hub.flushed == [{"a"}]                  # none of them flushed yet...
    assert len(scheduled) == 1 and 99.0 < scheduled[0][0] <= 100.0   # ...one flush is due at the gap's end
    fired_at = loop.time()
    scheduled[0][1]()                              # the timer fires
    assert hub.flushed == [{"a"}, {"a", "b"}]
    assert hub._next_flush_at >= fired_at          # the next gap runs from this flush's end
