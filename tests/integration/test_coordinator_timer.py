"""The deadline timer wakes only when a deadline is due or a call set an earlier one: polls that
merely renew leases never wake it (aioquic's rule: re-arm only when the deadline moves); and it
walks the nodes for the next deadline only after a tick."""
from __future__ import annotations

import asyncio

from protocol.messages import JobConfig, JoinRequest, PollRequest
from rdzv_server.coordinator import Coordinator
from rdzv_server.core.events import EventKind
from rdzv_server.core.outbox import Outbox


def join(node: str, config: JobConfig) -> JoinRequest:
    return JoinRequest(v=1, node_id=node, addr="10.0.0.1", local_world_size=1, master_port=1, config=config,
                       instance=node)


def first_loss(coord: Coordinator) -> asyncio.Future[Outbox]:
    """Resolved with the effects of the first node_lost event."""
    lost: asyncio.Future[Outbox] = asyncio.get_running_loop().create_future()

    def on_effects(effects: Outbox) -> None:
        if not lost.done() and any(ev.kind == EventKind.NODE_LOST for _, ev in effects.events):
            lost.set_result(effects)

    coord.effect_listeners.append(on_effects)
    return lost


async def test_renewals_do_not_wake_the_timer_but_an_earlier_deadline_does():
    coord = Coordinator()
    lost = first_loss(coord)
    await coord.start()
    try:
        config = JobConfig(min_nodes=2, max_nodes=2, lease_timeout_s=600.0)
        a = await coord.handle("j", join("a", config))
        await coord.handle("j", join("b", config))
        for _ in range(100):                       # yields (no time passes) until the timer took the lease
            if coord.timer_wakeups:
                break
            await asyncio.sleep(0)
        woken = coord.timer_wakeups
        assert woken == 1                          # the first deadline (a lease) armed it, once
        for _ in range(50):
            await coord.handle("j", PollRequest(v=1, node_id="a", credential=a.credential, known_round=1,
                                                        wait_s=0.0))
            await asyncio.sleep(0)                 # a yield: the timer task runs if it was woken
        assert coord.timer_wakeups == woken        # 50 renewals: not one wake-up
        coord.core.connection_dropped("j", "b", coord.clock())   # grace of 1 s: far before the leases
        coord.apply()
        await asyncio.wait_for(lost, 10.0)
        assert coord.timer_wakeups >= woken + 1
        assert "b" not in coord.core.jobs["j"].nodes
    finally:
        await coord.stop()


async def test_an_earlier_deadline_is_taken_as_it_is_and_the_nodes_are_walked_again_only_after_a_tick():
    # Waking the timer for a deadline brought forward does not look for the next deadline again (a
    # walk over every node: a fleet coming back after a blip woke it thousands of times); the tick
    # at that deadline does.
    coord = Coordinator()
    walks = 0
    real_next = coord.core.next_deadline

    def counted() -> float | None:
        nonlocal walks
        walks += 1
        return real_next()

    coord.core.next_deadline = counted            # type: ignore[method-assign]
    lost = first_loss(coord)
    await coord.start()
    try:
        config = JobConfig(min_nodes=3, max_nodes=3, lease_timeout_s=600.0)
        for node in ("a", "b", "c"):
            await coord.handle("j", join(node, config))
        for _ in range(100):                       # yields until the timer armed the first lease
            if coord.timer_wakeups:
                break
            await asyncio.sleep(0)
        before, woken = walks, coord.timer_wakeups
        coord.core.connection_dropped("j", "b", coord.clock())     # an earlier deadline: b's 1 s grace
        coord.apply()
        for _ in range(100):
            if coord.timer_wakeups > woken:
                break
            await asyncio.sleep(0)
        assert coord.timer_wakeups == woken + 1 and walks == before    # woken, no walk
        await asyncio.wait_for(lost, 10.0)                              # the grace ran out: b lost
        for _ in range(100):
            if walks > before:
                break
            await asyncio.sleep(0)
        assert walks > before                                           # after the tick: walked again
        assert "b" not in coord.core.jobs["j"].nodes
    finally:
        await coord.stop()
