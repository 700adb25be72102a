"""Is the path to the server back? Asked over a fresh connection, never the one a request waits on.

A connection opened or in use while the path was down sits in TCP's retransmission back-off (SYN and
segment retries at 1, 2, 4, 8 s): waiting on it learns that the path is back only at its next retry.
So once a request's answer is overdue (`answer_due`: a held poll's hold, as the server said it, plus
HOLD_MARGIN_S; any other request SHORT_DUE_S), the client asks every endpoint's /readyz over a new
connection, each with CHECK_TIMEOUT_S, and:
- one answers ready: the path is back; the request goes again at once, there (the stalled
  connection is closed), a replica taking over included;
- none does (refused, silent, or 503 from a standby or a restarting server): the server is away for
  now; the client waits for the next check, on `CheckSchedule`: about every CHECK_EVERY_S, jittered so
  a fleet does not come back in one wave, never sooner than MIN_PAUSE_S after the last one.
Checks are shared (`PathCheck`): requests overdue together cause one round of checks, not one each,
so a node checks each endpoint at most 1 / MIN_PAUSE_S times a second, whatever it has in flight.
"""
from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable

SHORT_DUE_S = 2.0        # a join, report or leave is answered well within this (its durable commit included)
HOLD_MARGIN_S = 1.0      # a held poll's answer is due this long after its hold ends
CHECK_EVERY_S = 0.5
CHECK_JITTER = (0.7, 1.3)
MIN_PAUSE_S = 0.3        # never more than about 3 rounds of checks a second
CHECK_TIMEOUT_S = 1.0    # a server that does not answer /readyz on a new connection within this is away

# Answers that mean the endpoint is there but not serving (a standby, a restarting server, a gateway
# whose server is away): checked again on the schedule.
NOT_SERVING = frozenset({502, 503, 504})

# What one round of checks found (PathCheck.reach), for a caller deciding whether it is cut off:
REACHED = "reached"      # an endpoint answers ready: the path is back
STANDBY = "standby"      # endpoints answer but none serves yet: a restart or replica takeover is under way
NO_SERVER = "none"       # no endpoint answers at all

Probe = Callable[[str], Awaitable[int | None]]   # an endpoint -> its /readyz HTTP status (None: no answer)


def answer_due(action: str, wait_s: float, hold_s: float) -> float:
    """How long a request may go unanswered before the path is checked. `hold_s`: the longest the
    server said it holds this node's polls (0: not said, an older server: the poll's own wait)."""
    if action != "poll" or wait_s <= 0:
        return SHORT_DUE_S
    return min(wait_s, hold_s if hold_s > 0 else wait_s) + HOLD_MARGIN_S


class CheckSchedule:
    """The pauses between rounds of checks: about CHECK_EVERY_S, jittered, never under MIN_PAUSE_S."""

    def __init__(self, every_s: float = CHECK_EVERY_S,
                 jitter: Callable[[float, float], float] = random.uniform) -> None:
        self.every_s, self._jitter = every_s, jitter

    def next_pause(self) -> float:
        return max(MIN_PAUSE_S, self.every_s * self._jitter(*CHECK_JITTER))


class PathCheck:
    """Rounds of /readyz checks over fresh connections (`probe`), shared by every request of a client."""

    def __init__(self, probe: Probe, schedule: CheckSchedule | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self._probe = probe
        self.schedule = schedule or CheckSchedule()
        self._clock, self._sleep = clock, sleep
        self._lock = asyncio.Lock()
        self._last: tuple[float, str | None] | None = None   # (when the last round ended, its answer)
        self.answered = False                                # the last round: did any endpoint answer HTTP?
        self.rounds = 0                                      # rounds of checks made (for tests and logs)

    async def check(self, endpoints: list[str]) -> str | None:
        """One round: the first of `endpoints` (in order of preference) that answers ready, or None.
        A round that ended less than MIN_PAUSE_S ago is not repeated: its answer is the answer."""
        async with self._lock:
            if self._last is not None and self._clock() - self._last[0] < MIN_PAUSE_S:
                return self._last[1]
            statuses = await asyncio.gather(*(self._probe(e) for e in endpoints))
            self.rounds += 1
            ready = next((e for e, s in zip(endpoints, statuses) if s is not None and s not in NOT_SERVING), None)
            self._last, self.answered = (self._clock(), ready), any(s is not None for s in statuses)
            return ready

    async def reach(self, endpoints: list[str]) -> str:
        """REACHED, STANDBY or NO_SERVER, by one round of checks (or the last one, if that was just now)."""
        if await self.check(endpoints) is not None:
            return REACHED
        return STANDBY if self.answered else NO_SERVER

    async def until_back(self, endpoints: Callable[[], list[str]]) -> str:
        """Check on the schedule until an endpoint answers ready; that endpoint. Cancel to stop."""
        while True:
            ready = await self.check(endpoints())
            if ready is not None:
                return ready
            await self._sleep(self.schedule.next_pause())   # waiting out an outage: nothing to await
