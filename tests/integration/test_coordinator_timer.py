"""The deadline timer wakes only when a deadline is due or a call set an earlier one: polls that
merely renew leases never wake it (aioquic's rule: re-arm only when the deadline moves)."""
from __future__ import annotations

import asyncio

from protocol.messages import JobConfig, JoinRequest, PollRequest
from rdzv_server.coordinator import Coordinator
from rdzv_server.core.events import EventKind
from rdzv_server.core.outbox import Outbox


def join(node: str, config: JobConfig) -> JoinRequest:
    return JoinRequest(v=1, node_id=node, addr="10.0.0.1", local_world_size=1, master_port=1, config=config,
                       instance=node)


async def test_renewals_do_not_wake_the_timer_but_an_earlier_deadline_does():
    coord = Coordinator()
    lost = asyncio.get_running_loop().create_future()

    def on_effects(effects: Outbox) -> None:
        if not lost.done() and any(ev.kind == EventKind.NODE_LOST for _, ev in effects.events):
            lost.set_result(effects)

    coord.effect_listeners.append(on_effects)
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
        coord._apply()
        await asyncio.wait_for(lost, 10.0)
        assert coord.timer_wakeups >= woken + 1
        assert "b" not in coord.core.jobs["j"].nodes
    finally:
        await coord.stop()
