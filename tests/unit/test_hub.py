"""The delivery hub's own rules (rdzv_server/delivery/): holds end on a grid, never in a busy loop; a
woken job's pass pushes only news, and hands back to its owner what it cannot push."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import uvloop  # a test dependency (pyproject's test extra): the loop whose clock counts milliseconds

from protocol.messages import NodeStatus
from rdzv_server.core.rendezvous import Rendezvous
from rdzv_server.delivery.holds import HOLD_TICK_S, HoldGrid
from rdzv_server.delivery.hub import Hub
from rdzv_server.delivery.subscriber import Subscriber
from rdzv_server.serving import Serving
from tests.unit.test_rendezvous import JOB, cfg, join


def _hold_ends(n: int, spread_s: float) -> tuple[int, list[float]]:
    """n holds ending over `spread_s` on uvloop (whole-millisecond clock): timer calls, and how late each
    hold ended (negative: early)."""
    fires = 0
    original = HoldGrid._due

    def counted(self: HoldGrid) -> None:
        nonlocal fires
        fires += 1
        original(self)

    async def run() -> list[float]:
        loop = asyncio.get_running_loop()
        ended: dict[int, float] = {}
        all_ended = asyncio.Event()

        def end(entry: object) -> None:
            ended.setdefault(id(entry), loop.time())
            if len(ended) == n:
                all_ended.set()
        grid = HoldGrid(end, lambda entry: id(entry) in ended)
        start = loop.time() + 0.05
        entries = [(object(), start + spread_s * i / n) for i in range(n)]
        for entry, at in entries:
            grid.add(at, entry)
        await asyncio.wait_for(all_ended.wait(), 10)
        return [ended[id(entry)] - at for entry, at in entries]

    HoldGrid._due = counted      # type: ignore[method-assign]
    try:
        late = uvloop.run(run())
    finally:
        HoldGrid._due = original  # type: ignore[method-assign]
    return fires, late


def test_holds_ending_within_milliseconds_of_each_other_take_one_timer_call_a_tick():
    n, spread = 2000, 0.2            # an end every 0.1 ms: what 10,000 nodes' holds look like
    fires, late = _hold_ends(n, spread)
    # one call a tick (and a few for the loop's own rounding), not one or more per millisecond per end
    assert fires <= spread / HOLD_TICK_S + 10, fires
    # each hold ends within a tick of its end, either side (the clock itself counts milliseconds)
    assert min(late) >= -HOLD_TICK_S - 0.001 and max(late) <= 2 * HOLD_TICK_S + 0.05, (min(late), max(late))


class Recorded(Subscriber):
    def __init__(self, node_id: str, known_round: int, push_result: bool | Exception = True) -> None:
        super().__init__(JOB, node_id, known_round, None)
        self.push_result = push_result
        self.pushed: list[NodeStatus] = []
        self.closed: list[bool] = []
        self.told = asyncio.Event()

    def push(self, view: NodeStatus) -> bool:
        if isinstance(self.push_result, Exception):
            raise self.push_result
        self.pushed.append(view)
        return self.push_result

    def close(self, *, ended: bool, hang_up: bool = False) -> None:
        self.closed.append(ended)
        self.told.set()


def test_a_pass_pushes_news_only_and_hands_back_what_it_cannot_push():
    """Three nodes wait in round -1 while a fourth joins (no news for them: their view is `waiting`
    either way); then the round forms: pushed where the subscriber can, closed (its owner looks) where
    its push fails or raises, and closed for everyone while the change is not yet saved."""
    async def run() -> None:
        core = Rendezvous()
        for n in ("a", "b", "c"):
            join(core, n, 0.0, cfg(min_nodes=4, max_nodes=4, last_call_s=0.0))
        driver = SimpleNamespace(core=core, gate=Serving(), clock=lambda: 1.0, apply=lambda: None)
        driver.gate.start()
        hub = Hub(driver)   # type: ignore[arg-type]
        subs = {"a": Recorded("a", -1), "b": Recorded("b", -1, push_result=False),
                "c": Recorded("c", -1, push_result=RuntimeError("a bug in the writer"))}
        loop = asyncio.get_running_loop()
        for sub in subs.values():
            sub.ends = loop.time() + 60
            hub.wait(sub)
        hub.wake(JOB, saved=True)                        # nothing new for anyone
        assert all(not s.pushed and not s.closed for s in subs.values())
        join(core, "d", 1.0, cfg(min_nodes=4, max_nodes=4, last_call_s=0.0))    # the round forms
        hub.wake(JOB, saved=True)
        assert [v.round_id for v in subs["a"].pushed] == [1] and not subs["a"].closed
        assert subs["b"].closed == [False] and subs["c"].closed == [False]
        hub.wake(JOB, saved=True)                        # each was told once: no longer waiting
        assert len(subs["a"].pushed) == 1 and subs["b"].closed == [False]

        late = Recorded("a", -1)                         # round 1 is news to it ...
        late.ends = loop.time() + 60
        hub.wait(late)
        hub.wake(JOB, saved=False)                       # ... but a change not yet in the store is never shown
        assert late.pushed == [] and late.closed == [False]

    asyncio.run(run())


def test_a_hold_that_ends_closes_its_subscriber_as_ended_and_a_wake_does_not():
    async def run() -> None:
        core = Rendezvous()
        join(core, "a", 0.0, cfg())
        driver = SimpleNamespace(core=core, gate=Serving(), clock=lambda: 1.0, apply=lambda: None)
        hub = Hub(driver)   # type: ignore[arg-type]
        loop = asyncio.get_running_loop()
        timed, woken = Recorded("a", -1), Recorded("a", -1)
        timed.ends, woken.ends = loop.time() + 0.02, loop.time() + 60
        hub.wait(timed)
        hub.wait(woken)
        hub.wake_all()                  # not serving: every waiting subscriber looks again
        assert woken.closed == [False] and timed.closed == [False]
        again = Recorded("a", -1)
        again.ends = loop.time() + 0.02
        hub.wait(again)
        await asyncio.wait_for(again.told.wait(), 10)
        assert again.closed == [True]

    asyncio.run(run())


def test_a_close_that_came_in_while_the_loop_stalled_is_still_the_hosts():
    """A held poll's connection closed by its node's host (its agent killed) while the server's loop stalled:
    its last ACK is as old as the stall when the loop gets to it, and it still reads as the host's close (the
    node may be restarting: awaiting.restarting), not as a keepalive giving up; without a stall, as old is not."""
    def dropped_heard(ack_age_s: float, lag_s: float) -> bool:
        core = Rendezvous()
        join(core, "a", 0.0, cfg())
        driver = SimpleNamespace(core=core, gate=Serving(), clock=lambda: 1.0, call=lambda fn: fn(1.0),
                                 lag_s=lambda: lag_s)
        sub = Recorded("a", -1)
        sub.ack_age = lambda: ack_age_s
        Hub(driver).detach(sub, "127.0.0.1", dropped=True)   # type: ignore[arg-type]
        node = core.jobs[JOB].nodes["a"]
        assert node.dropped
        return node.drop_heard

    assert dropped_heard(ack_age_s=4.8, lag_s=5.0)        # a 5 s stall: the FIN came in during it
    assert not dropped_heard(ack_age_s=4.8, lag_s=0.0)    # 4.8 s of silence on a loop on time: not the host's
    assert dropped_heard(ack_age_s=0.1, lag_s=0.0)


def test_a_held_poll_closed_by_its_host_but_unread_is_named_once_and_its_later_detach_touches_nothing():
    """A member's agent killed as the loop runs late: its FIN is in (CLOSE_WAIT) but unread when its peers' failure
    reports are read. The hub names it (the coordinator tells the core its loss first); when the loop reads the close
    later, a record made since by its new agent is left alone."""
    core = Rendezvous()
    join(core, "a", 0.0, cfg())
    calls: list[str] = []
    driver = SimpleNamespace(core=core, gate=Serving(), clock=lambda: 1.0, call=lambda fn: calls.append("call"),
                             lag_s=lambda: 0.0)
    hub = Hub(driver)   # type: ignore[arg-type]
    closed, open_ = Recorded("a", -1), Recorded("b", -1)
    closed.peer_closed, open_.peer_closed = (lambda: True), (lambda: False)
    closed.ends = open_.ends = float("inf")
    hub.wait(closed)
    hub.wait(open_)
    assert hub.closed_unread(JOB) == ["a"] and closed.drop_told and not open_.drop_told
    hub.detach(closed, "127.0.0.1", dropped=True)
    assert calls == []                                   # told already: nothing more for the core
    hub.detach(open_, "127.0.0.1", dropped=True)
    assert calls == ["call"]
