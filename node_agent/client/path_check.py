"""Is the path to the server back? Asked over a fresh connection, never the one a request waits on: that
one sits in TCP's retransmission back-off and would see the path back only at its next retry.
Once an answer is overdue (`answer_due`), every endpoint's /readyz is asked on a new connection:
- one answers ready: the request goes again at once, there (the stalled connection closed; a replica too);
- none does (refused, silent, 503: a standby or a restarting server): the server is away. The request keeps
  its connection (it may yet be answered; keepalive ends it), since closing it would tell the server the
  node left; checks repeat on `CheckSchedule`, jittered so a fleet does not come back in one wave.
Checks are shared (`PathCheck`): one round for all overdue requests, each endpoint at most 1 / MIN_PAUSE_S
times a second. A request that has connected (`connected()`, before TLS) is kept up to ANSWER_WAIT_S and
reused by the next rounds: abandoned, it would stay in the server's accept queue, one more each round."""
from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from node_agent.client.replies import Path

SHORT_DUE_S = 2.0        # a join, report or leave is answered well within this (its durable commit included)
HOLD_MARGIN_S = 1.0      # a held poll's answer is due this long after its hold ends
CHECK_EVERY_S = 0.5
CHECK_JITTER = (0.7, 1.3)
MIN_PAUSE_S = 0.3        # never more than about 3 rounds of checks a second
CHECK_TIMEOUT_S = 1.0    # a server that does not answer /readyz on a new connection within this is away
ANSWER_WAIT_S = 10.0     # a request that has connected waits this long for its answer (the server is there)

# The endpoint is there but not serving (a standby, a restarting server, a gateway): check again later.
NOT_SERVING = frozenset({502, 503, 504})

Readyz = Callable[[str], Awaitable[int | None]]   # an endpoint -> its /readyz HTTP status (None: no answer)


def poll_wait(wanted_s: float, hold_s: float) -> float:
    """The `wait_s` a poll asks for: at most the hold the server last said (`hold_s`, 0: not said). A longer
    poll would go overdue and be resent, closing a held connection the server must not count as the node gone."""
    return min(wanted_s, hold_s) if hold_s > 0 else wanted_s


def answer_due(action: str, wait_s: float, hold_s: float) -> float:
    """How long a request may go unanswered before the path is checked (`hold_s`: the server's hold, 0: not said)."""
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


@dataclass
class _Kept:
    """A request that has connected, kept beyond its round; `ended`: when it got its answer (or gave up)."""
    request: asyncio.Future[int | None]
    ended: float | None = None


class PathCheck:
    """Rounds of /readyz checks over fresh connections, shared by a client's requests: at most one round per
    MIN_PAUSE_S. `until_back` starts rounds on the schedule even while one waits on a silent endpoint, so a
    healed path is seen within one pause; a kept request's answer serves the next round within CHECK_TIMEOUT_S."""

    def __init__(self, readyz: Readyz, schedule: CheckSchedule | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._readyz = readyz
        self.schedule = schedule or CheckSchedule()
        self._clock = clock
        self._latest: tuple[float, asyncio.Future[str | None]] | None = None   # (when it started, the round)
        self._endpoint_of: dict[asyncio.Future[int | None], str] = {}          # requests under way
        self._kept: dict[str, _Kept] = {}                                       # by endpoint
        self.answered = False       # the last round that ended: did any endpoint answer HTTP?

    def _start(self, endpoints: list[str]) -> asyncio.Future[str | None]:
        now = self._clock()
        if self._latest is None or now - self._latest[0] >= MIN_PAUSE_S:
            self._latest = (now, asyncio.ensure_future(self._round(endpoints)))
        return self._latest[1]

    def connected(self) -> None:
        """Told by a request (from its own task) once connected: kept past its round, the next rounds reuse it."""
        task = asyncio.current_task()
        if task is not None and (endpoint := self._endpoint_of.get(task)) is not None:
            kept = self._kept[endpoint] = _Kept(task)
            task.add_done_callback(lambda _: setattr(kept, "ended", self._clock()))

    def _request_for(self, endpoint: str) -> asyncio.Future[int | None]:
        """The kept request of `endpoint` (under way, or its answer if fresh: taken once), else a new one."""
        kept = self._kept.get(endpoint)
        if kept is not None:
            if kept.ended is None:
                return kept.request
            del self._kept[endpoint]
            if self._clock() - kept.ended <= CHECK_TIMEOUT_S:
                return kept.request
        request = asyncio.ensure_future(self._readyz(endpoint))
        self._endpoint_of[request] = endpoint
        request.add_done_callback(self._endpoint_of.pop)
        return request

    async def _round(self, endpoints: list[str]) -> str | None:
        """Every endpoint at once for up to CHECK_TIMEOUT_S; the first ready ends it (a silent leader is not
        waited for), the earliest given among those answering together."""
        requests = {self._request_for(e): e for e in endpoints}
        pending, answered, ready = set(requests), False, None
        ends = asyncio.get_running_loop().time() + CHECK_TIMEOUT_S
        try:
            while pending and ready is None and (left := ends - asyncio.get_running_loop().time()) > 0:
                done, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                statuses = {requests[f]: _status(f) for f in done}
                answered = answered or any(s is not None for s in statuses.values())
                ready = next((e for e in endpoints if statuses.get(e) is not None
                              and statuses[e] not in NOT_SERVING), None)
        finally:
            kept = {k.request for k in self._kept.values()}
            dropped = [f for f in pending if f not in kept]
            for f in dropped:
                f.cancel()
            await asyncio.gather(*dropped, return_exceptions=True)
        self.answered = answered
        return ready

    async def check(self, endpoints: list[str]) -> str | None:
        """The first of `endpoints` (by preference) ready, or None: by a new round or one under MIN_PAUSE_S old."""
        return await asyncio.shield(self._start(endpoints))

    async def reach(self, endpoints: list[str]) -> Path:
        """Path.REACHED, Path.STANDBY or Path.NO_SERVER, by one round of checks (or the one just made)."""
        if await self.check(endpoints) is not None:
            return Path.REACHED
        return Path.STANDBY if self.answered else Path.NO_SERVER

    async def close(self) -> None:
        """Stop a round and the kept requests still under way (the client is closing)."""
        stop: list[asyncio.Future[Any]] = [k.request for k in self._kept.values()]
        if self._latest is not None:
            stop.append(self._latest[1])
        self._kept.clear()
        for f in stop:
            f.cancel()
        await asyncio.gather(*stop, return_exceptions=True)

    async def until_back(self, endpoints: Callable[[], list[str]]) -> str:
        """A round on the schedule until one finds an endpoint ready; that endpoint. Cancel to stop."""
        loop = asyncio.get_running_loop()
        outstanding: set[asyncio.Future[str | None]] = set()
        while True:
            outstanding.add(self._start(endpoints()))
            ends = loop.time() + self.schedule.next_pause()
            while (left := ends - loop.time()) > 0:
                if not outstanding:
                    await asyncio.sleep(left)      # the rest of the pause: waiting out an outage
                    break
                done, outstanding = await asyncio.wait(outstanding, timeout=left,
                                                       return_when=asyncio.FIRST_COMPLETED)
                ready = next((r for r in (f.result() for f in done) if r is not None), None)
                if ready is not None:
                    return ready


def _status(request: asyncio.Future[int | None]) -> int | None:
    """A request's answer (None: none, or it was stopped)."""
    return None if request.cancelled() or request.exception() is not None else request.result()
