"""How long a poll is held, and the one timer that ends holds.

All nodes together poll about TARGET_POLL_RATE times a second: a hold is the node count over that rate,
at least half a lease (the open poll is the lease), at most MAX_HOLD_S, jittered against waves. Holds
end on a HOLD_TICK_S grid, one timer for the earliest: uvloop's clock counts whole ms, so a timer armed
for less away would fire, find nothing due and re-arm (a busy loop).
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import random
from collections.abc import Callable

import msgspec

from protocol.messages import NodeStatus

TARGET_POLL_RATE = 500.0
MAX_HOLD_S = 30.0           # the agent asks for up to 60 s
HOLD_TICK_S = 0.01          # a hold may end this much early or late: nothing next to holds of seconds


def hold_base(node_count: int, status: NodeStatus) -> float:
    """The longest hold now (what replies tell agents: poll_hold_s)."""
    return min(max(node_count / TARGET_POLL_RATE, status.lease_timeout_s / 2), MAX_HOLD_S)


def with_hold(node_count: int, status: NodeStatus) -> NodeStatus:
    """`status` as replies carry it: with the longest hold now (poll_hold_s), the hold agents should expect."""
    return msgspec.structs.replace(status, poll_hold_s=round(hold_base(node_count, status), 3))


def hold_for(node_count: int, status: NodeStatus, wait_s: float) -> float:
    """This poll's hold: `hold_base` jittered down by up to a fifth, never longer than the agent asked."""
    return min(wait_s, hold_base(node_count, status) * random.uniform(0.8, 1.0))


class HoldGrid:
    """Calls `end(entry)` at each entry's time (on the grid), skipping entries already `finished(entry)`."""

    def __init__(self, end: Callable[[object], None], finished: Callable[[object], bool]) -> None:
        self._end, self._finished = end, finished
        self._heap: list[tuple[float, int, object]] = []
        self._seq = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")

    def add(self, at: float, entry: object) -> None:
        heapq.heappush(self._heap, (at, next(self._seq), entry))
        if at < self._timer_at:
            self._arm(at)

    def _arm(self, at: float) -> None:
        at = math.ceil(at / HOLD_TICK_S) * HOLD_TICK_S
        if at >= self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = asyncio.get_running_loop().call_at(at, self._due)

    def _due(self) -> None:
        self._timer, self._timer_at = None, float("inf")
        due = asyncio.get_running_loop().time() + HOLD_TICK_S    # what ends before the next tick ends now
        heap = self._heap
        while heap and (heap[0][0] <= due or self._finished(heap[0][2])):
            entry = heapq.heappop(heap)[2]
            if not self._finished(entry):
                self._end(entry)
        if heap:
            self._arm(heap[0][0])
