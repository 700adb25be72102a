"""Held long-polls' timer (rdzv_server/waiters.py): holds end on a grid, never in a busy loop."""
from __future__ import annotations

import asyncio

import uvloop  # a test dependency (pyproject's test extra): the loop whose clock counts milliseconds

from rdzv_server import waiters as waiters_mod
from rdzv_server.waiters import HOLD_TICK_S, Waiter, Waiters, Wake


def _hold_ends(n: int, spread_s: float) -> tuple[int, list[float], list[bool]]:
    """n holds ending over `spread_s` on uvloop (whole-millisecond clock): timer calls, how late each
    hold ended (negative: early), and whether each was ended by its hold."""
    fires = 0
    original = Waiters._holds_ended

    def counted(self: Waiters) -> None:
        nonlocal fires
        fires += 1
        original(self)

    async def run() -> tuple[list[float], list[bool]]:
        loop = asyncio.get_running_loop()
        ws, start = Waiters(), loop.time() + 0.05
        held = [Waiter("job", start + spread_s * i / n) for i in range(n)]
        for w in held:
            ws.add(w)
        late: list[float] = []
        for w in held:
            await w.fut
            late.append(loop.time() - w.ends)
        return late, [w.ended for w in held]

    waiters_mod.Waiters._holds_ended = counted      # type: ignore[method-assign]
    try:
        late, ended = uvloop.run(run())
    finally:
        waiters_mod.Waiters._holds_ended = original  # type: ignore[method-assign]
    return fires, late, ended


def test_holds_ending_within_milliseconds_of_each_other_take_one_timer_call_a_tick():
    n, spread = 2000, 0.2            # an end every 0.1 ms: what 10,000 nodes' holds look like
    fires, late, ended = _hold_ends(n, spread)
    assert all(ended)
    # one call a tick (and a few for the loop's own rounding), not one or more per millisecond per end
    assert fires <= spread / HOLD_TICK_S + 10, fires
    # each hold ends within a tick of its end, either side (the clock itself counts milliseconds)
    assert min(late) >= -HOLD_TICK_S - 0.001, min(late)


def test_a_wake_is_not_a_hold_ending():
    async def run() -> tuple[bool, bool]:
        loop = asyncio.get_running_loop()
        ws = Waiters()
        woken, timed = Waiter("a", loop.time() + 60), Waiter("b", loop.time() + 0.02)
        ws.add(woken)
        ws.add(timed)
        ws.wake_job("a")
        await woken.fut
        await timed.fut
        return woken.ended, timed.ended

    assert uvloop.run(run()) == (False, True)


def test_a_change_is_settled_without_the_task_where_the_poll_can_say():
    """Wake.UNCHANGED leaves the poll held (its future pending), SENT marks it sent and wakes its
    task to catch up, LOOK (or an `answer` that raises) wakes the task to look itself."""
    async def run() -> None:
        outcomes = {"unchanged": Wake.UNCHANGED, "sent": Wake.SENT, "look": Wake.LOOK}
        ws = Waiters()
        held = {name: Waiter("job", 1e9, answer=lambda o=o: o) for name, o in outcomes.items()}

        def broken() -> Wake:
            raise RuntimeError("a bug in the writer")
        held["broken"] = Waiter("job", 1e9, answer=broken)
        held["plain"] = Waiter("job", 1e9)
        for w in held.values():
            ws.add(w)
        ws.wake_job("job")
        assert not held["unchanged"].fut.done()
        assert held["sent"].fut.done() and held["sent"].sent
        for name in ("look", "broken", "plain"):
            assert held[name].fut.done() and not held[name].sent, name

    asyncio.run(run())
