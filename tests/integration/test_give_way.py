"""At the connection limit with none idle, a held poll gives way (delivery/give_way.py): a node's polls beyond its
first, then a node's in no running round, then a running member's, one at random in each; answered
with the node's view and its connection hung up, so its descriptor goes to the newcomer."""
from __future__ import annotations

import asyncio

from protocol.messages import JobConfig, JoinRequest, NodeState, NodeStatus, PollRequest
from rdzv_server.coordinator import Coordinator
from rdzv_server.delivery.connection import Connection
from tests.integration.test_poll_limits import held

RUNNING = JobConfig(min_nodes=1, max_nodes=1, lease_timeout_s=600.0, last_call_s=0.0)
WAITING = JobConfig(min_nodes=3, max_nodes=3, lease_timeout_s=600.0)


async def join(coord: Coordinator, job: str, node: str, config: JobConfig) -> NodeStatus:
    return await coord.handle(job, JoinRequest(v=1, node_id=node, addr="10.0.0.1", local_world_size=1, master_port=1,
                                               config=config, instance=node), Connection(peer="192.0.2.1"))


async def test_polls_give_way_extra_ones_first_then_outside_a_running_round_then_members():
    coord = Coordinator()
    await coord.start()
    hung_up: list[str] = []
    polls: dict[str, asyncio.Future[NodeStatus]] = {}
    try:
        member = await join(coord, "run", "m", RUNNING)
        assert member.assignment is not None
        waiting = {n: await join(coord, "wait", n, WAITING) for n in ("w1", "w2")}

        async def hold(name: str, job: str, node: str, status: NodeStatus) -> None:
            known = status.assignment.round_id if status.assignment else -1
            req = PollRequest(v=1, node_id=node, credential=status.credential, known_round=known, wait_s=60.0)
            polls[name] = asyncio.ensure_future(coord.handle(job, req, Connection(
                peer="192.0.2.1", hang_up=lambda: hung_up.append(name))))
            await held(coord, len(polls))

        await hold("m", "run", "m", member)
        await hold("w1", "wait", "w1", waiting["w1"])
        await hold("w2", "wait", "w2", waiting["w2"])
        await hold("w2-again", "wait", "w2", waiting["w2"])     # a second poll of one node
        for tier in ({"w2-again"}, {"w1", "w2"}, {"w1", "w2"}, {"m"}):     # at random within a tier
            assert coord.hub.give_way()
            await held(coord, len(polls) - len(hung_up))
            assert hung_up[-1] in tier and len(set(hung_up)) == len(hung_up)
            answer = await asyncio.wait_for(polls[hung_up[-1]], 10)
            assert answer.node_state == (NodeState.MEMBER if hung_up[-1] == "m" else NodeState.WAITING), answer
            assert not [n for n, p in polls.items() if p.done() and n not in hung_up]
        assert not coord.hub.give_way() and coord.hub.open == 0 and coord.hub.gave_way == 4
        assert coord.core.jobs["run"].restart_count == 0 and "m" in coord.core.jobs["run"].nodes
    finally:
        for p in polls.values():
            p.cancel()
        await coord.stop()
