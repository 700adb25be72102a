"""The client's "is the path back?" schedule (node_agent/client/path_check.py), with fake requests and
recorded pauses: bounded rate, jitter, standbys and silent endpoints waited for, shared rounds."""
from __future__ import annotations

import asyncio

from node_agent.client.path_check import (
    CHECK_EVERY_S,
    HOLD_MARGIN_S,
    MIN_PAUSE_S,
    SHORT_DUE_S,
    CheckSchedule,
    PathCheck,
    answer_due,
)
from node_agent.client.replies import Path


class Recorded(CheckSchedule):
    def __init__(self) -> None:
        super().__init__()
        self.pauses: list[float] = []

    def next_pause(self) -> float:
        self.pauses.append(super().next_pause())
        return self.pauses[-1]


class Fake:
    """Endpoints answering what `answers` says, in turn (None: no answer at all; `silent`: an answer
    only after `silent` seconds, as a request of an endpoint whose path is down)."""

    def __init__(self, answers: dict[str, list[int | None]], silent: float = 0.0) -> None:
        self.answers = answers
        self.asked: list[str] = []
        self.now = 0.0
        self.silent = silent
        self.schedule = Recorded()

    async def request(self, endpoint: str) -> int | None:
        self.asked.append(endpoint)
        seq = self.answers[endpoint]
        answer = seq.pop(0) if len(seq) > 1 else seq[0]
        if answer is None and self.silent:
            await asyncio.sleep(self.silent)     # stands in for a request's own timeout
        return answer

    def check(self, fake_clock: bool = False) -> PathCheck:
        return PathCheck(self.request, self.schedule, **({"clock": lambda: self.now} if fake_clock else {}))


def test_an_answer_is_due_after_the_servers_hold_plus_a_margin_and_other_requests_soon():
    assert answer_due("poll", 60.0, 2.5) == 2.5 + HOLD_MARGIN_S
    assert answer_due("poll", 1.0, 2.5) == 1.0 + HOLD_MARGIN_S       # the poll asked for less than the hold
    assert answer_due("poll", 60.0, 0.0) == 60.0 + HOLD_MARGIN_S      # an older server says no hold
    assert answer_due("poll", 0.0, 2.5) == SHORT_DUE_S                # an instant poll (the lease keeper)
    assert answer_due("join", 60.0, 2.5) == answer_due("failure", 0.0, 0.0) == SHORT_DUE_S


def test_the_schedule_is_jittered_around_its_period_and_never_tight():
    lows = CheckSchedule(jitter=lambda lo, hi: lo).next_pause()
    highs = CheckSchedule(jitter=lambda lo, hi: hi).next_pause()
    assert MIN_PAUSE_S <= lows < CHECK_EVERY_S < highs
    assert CheckSchedule(every_s=0.0).next_pause() == MIN_PAUSE_S     # a period of 0 is still not a tight loop
    pauses = {CheckSchedule().next_pause() for _ in range(50)}
    assert len(pauses) > 10 and min(pauses) >= MIN_PAUSE_S          # a fleet does not check in one wave


async def test_refusing_or_standby_endpoints_are_checked_on_the_schedule_until_one_serves():
    # a: refuses (no answer) three rounds, then serves; b: a standby (503) throughout.
    fake = Fake({"a": [None, None, None, 200], "b": [503]})
    check = fake.check()
    assert await check.until_back(lambda: ["a", "b"]) == "a"
    assert len(fake.schedule.pauses) == 4 and fake.asked.count("a") == 4   # one round per pause, never more
    assert all(p >= MIN_PAUSE_S for p in fake.schedule.pauses)
    assert fake.asked.count("b") == 4                                # every endpoint in every round


async def test_a_round_waiting_on_a_silent_endpoint_does_not_hold_up_the_next():
    # Each failed request takes 2 s (its timeout); the path heals at the fourth round: seen by that
    # round, started one pause after the third, not after the three timeouts in a row.
    fake = Fake({"a": [None, None, None, 200]}, silent=2.0)
    check = fake.check()
    assert await asyncio.wait_for(check.until_back(lambda: ["a"]), 10) == "a"
    assert fake.asked == ["a"] * 4 and sum(fake.schedule.pauses[:3]) < 2.0   # started before any timed out


async def test_a_standby_is_told_apart_from_nobody_and_a_replica_that_serves_is_preferred_in_order():
    assert await Fake({"a": [503], "b": [None]}).check().reach(["a", "b"]) == Path.STANDBY
    assert await Fake({"a": [None], "b": [None]}).check().reach(["a", "b"]) == Path.NO_SERVER
    fake = Fake({"a": [None], "b": [200], "c": [200]})
    assert await fake.check().check(["a", "b", "c"]) == "b"
    assert await Fake({"a": [200]}).check().reach(["a"]) == Path.REACHED


async def test_requests_overdue_together_share_one_round_of_checks():
    fake = Fake({"a": [None]})
    check = fake.check(fake_clock=True)
    answers = await asyncio.gather(*(check.check(["a"]) for _ in range(20)))
    assert answers == [None] * 20
    assert fake.asked == ["a"]                                       # not one check per request
    fake.now += MIN_PAUSE_S
    await check.check(["a"])
    assert fake.asked == ["a", "a"]                                  # the next round: a request of its own


async def test_a_replica_that_serves_is_taken_without_waiting_for_a_silent_one():
    # The leader went silent (its request waits out its timeout); the standby that took over answers
    # 200 at once: the round ends with it, and the silent request is stopped.
    class Silent(Fake):
        async def request(self, endpoint: str) -> int | None:
            if endpoint == "old":
                await asyncio.Event().wait()       # never answers: only cancelling ends it
            return 200

    fake = Silent({})
    assert await asyncio.wait_for(fake.check().check(["old", "new"]), 5) == "new"


async def test_a_request_that_connected_is_asked_again_by_the_next_rounds_not_opened_anew():
    # The path is back but the server is busy: the request connected and waits 2.5 s for its answer
    # (its connection in the server's accept queue). Rounds go on on the schedule, each lasting
    # CHECK_TIMEOUT_S, but none opens another connection: the one answer ends the wait.
    class Busy(Fake):
        async def request(self, endpoint: str) -> int | None:
            self.asked.append(endpoint)
            check.connected()
            await asyncio.sleep(2.5)
            return 200

    fake = Busy({"a": [200]})
    check = fake.check()
    assert await asyncio.wait_for(check.until_back(lambda: ["a"]), 10) == "a"
    assert len(fake.schedule.pauses) >= 2 and fake.asked == ["a"]     # rounds went on; one connection


async def test_a_request_that_never_connected_ends_with_its_round_and_the_next_round_opens_another():
    started, stopped = [], []

    class Silent(Fake):
        async def request(self, endpoint: str) -> int | None:
            started.append(endpoint)
            try:
                await asyncio.Event().wait()        # a SYN nobody answers: only its round ends it
            finally:
                stopped.append(endpoint)
            return None

    fake = Silent({})
    check = fake.check(fake_clock=True)
    assert await check.check(["a"]) is None
    assert stopped == ["a"]                          # given up with its round (CHECK_TIMEOUT_S)
    fake.now += MIN_PAUSE_S
    assert await check.check(["a"]) is None
    assert started == ["a", "a"]


async def test_a_kept_requests_answer_is_taken_by_the_next_round_once_and_close_stops_one_under_way():
    answer = asyncio.Event()

    class Slow(Fake):
        async def request(self, endpoint: str) -> int | None:
            self.asked.append(endpoint)
            check.connected()
            await answer.wait()
            return 200

    fake = Slow({})
    check = fake.check(fake_clock=True)
    assert await check.check(["a"]) is None          # connected, no answer within the round
    answer.set()
    await asyncio.sleep(0)                           # the kept request gets its answer between rounds
    fake.now += MIN_PAUSE_S
    assert await check.check(["a"]) == "a" and fake.asked == ["a"]   # taken from the kept request
    fake.now += MIN_PAUSE_S
    answer.clear()
    assert await check.check(["a"]) is None and fake.asked == ["a", "a"]   # used once: a new request
    await check.close()                              # stops the request kept from that round
    assert not check._kept                           # noqa: SLF001 (nothing left running)
