"""Held long-polls, woken together: no task, future-with-timeout or timer per poll.

Each held poll is one `Waiter` (a future and its hold's end, in the event loop's time). A job's
waiters are woken in one pass when the core says the job changed; holds that end are found by one
timer armed for the earliest end (a heap, entries of answered polls skipped lazily). A woken poll
looks at its node's view again and answers if it changed, or waits on until its hold ends.

A poll told of a change may be settled without its task (`Waiter.answer`, long_polls.py): nothing
new for it (it waits on, its task not woken: a node leaving or an operator's action wakes every poll
of the job, most of whose views stay as they were), or its reply written during the wake itself (its
task only catches up afterwards).

Holds end on a grid of HOLD_TICK_S: the timer fires at most once a tick, for every hold that ends
before the next one. uvloop's clock counts whole milliseconds, so a timer armed for an end less than
a millisecond away fired at once, found nothing due yet, and was armed again: a busy loop that took
40 us of CPU per hold end (151,000 timer calls for 10,000 ends over 2 s; 3-4 us and 21 calls with it).
"""
from __future__ import annotations

import asyncio
import enum
import heapq
import itertools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("rdzv_server")

HOLD_TICK_S = 0.01     # a hold may end this much early or late: nothing next to holds of seconds


class Wake(enum.Enum):
    """What a change meant for one held poll, decided without its task."""
    SENT = "sent"              # its reply went out now: the task only catches up (the poll's end)
    UNCHANGED = "unchanged"    # nothing new for this node: the poll waits on, its task not woken
    LOOK = "look"              # its task looks again (not serving, the job gone, a change not yet saved)


@dataclass(eq=False, slots=True)
class Waiter:
    job_id: str
    ends: float                                  # loop time at which the hold ends
    fut: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    ended: bool = False                          # woken because its hold ended (not by a change)
    # Told of a change, a poll may be settled without waking its task (see Wake): `answer` decides.
    answer: Callable[[], Wake] | None = None
    sent: bool = False                           # its reply went out during a wake (Wake.SENT)

    def wake(self) -> None:
        if self.fut.done():
            return
        if self.answer is not None:
            try:
                outcome = self.answer()
            except Exception:        # a bug: the task answers (or fails) on its own path
                log.exception("answering a woken poll failed")
                outcome = Wake.LOOK
            if outcome is Wake.UNCHANGED:
                return
            self.sent = outcome is Wake.SENT
        self.fut.set_result(None)

    def end(self) -> None:
        if not self.fut.done():
            self.ended = True
            self.fut.set_result(None)


class Waiters:
    def __init__(self) -> None:
        self._by_job: dict[str, set[Waiter]] = {}
        self._ends: list[tuple[float, int, Waiter]] = []
        self._seq = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")
        # Told of every wake too (streams.StreamHub): a job id, or None for all jobs. Must not raise.
        self.listeners: list[Callable[[str | None], None]] = []

    def __len__(self) -> int:
        return sum(len(ws) for ws in self._by_job.values())

    def add(self, waiter: Waiter) -> None:
        self._by_job.setdefault(waiter.job_id, set()).add(waiter)
        heapq.heappush(self._ends, (waiter.ends, next(self._seq), waiter))
        if waiter.ends < self._timer_at:
            self._arm(waiter.ends)

    def discard(self, waiter: Waiter) -> None:
        waiters = self._by_job.get(waiter.job_id)
        if waiters is not None:
            waiters.discard(waiter)
            if not waiters:
                del self._by_job[waiter.job_id]

    def wake_job(self, job_id: str) -> None:
        """Every poll held for `job_id` looks again, in one pass."""
        for waiter in self._by_job.get(job_id, ()):
            waiter.wake()
        for listener in self.listeners:
            listener(job_id)

    def wake_all(self) -> None:
        for waiters in self._by_job.values():
            for waiter in waiters:
                waiter.wake()
        for listener in self.listeners:
            listener(None)

    def _arm(self, at: float) -> None:
        at = math.ceil(at / HOLD_TICK_S) * HOLD_TICK_S      # on the grid: one timer for every end in a tick
        if at >= self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = asyncio.get_running_loop().call_at(at, self._holds_ended)

    def _holds_ended(self) -> None:
        self._timer, self._timer_at = None, float("inf")
        due = asyncio.get_running_loop().time() + HOLD_TICK_S    # what ends before the next tick ends now
        ends = self._ends
        while ends and (ends[0][0] <= due or ends[0][2].fut.done()):
            heapq.heappop(ends)[2].end()
        if ends:
            self._arm(ends[0][0])
