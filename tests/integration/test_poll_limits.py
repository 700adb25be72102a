"""Caps on held long-polls: counted per node credential (a client holding more polls for its node than
an agent ever does is refused), and per address only when an operator asks: many agents behind one
NAT address are all held."""
from __future__ import annotations

import asyncio

import pytest

from protocol.errors import ErrorCode
from protocol.messages import JobConfig, JoinRequest, NodeStatus, PollRequest
from rdzv_server.coordinator import Coordinator
from rdzv_server.core.errors import RendezvousError
from rdzv_server.delivery.connection import Connection

CONFIG = JobConfig(min_nodes=3, max_nodes=3, lease_timeout_s=600.0)


async def joined(coord: Coordinator, nodes: list[str]) -> dict[str, NodeStatus]:
    return {n: await coord.handle("j", JoinRequest(v=1, node_id=n, addr="10.0.0.1", local_world_size=1,
                                                    master_port=1, config=CONFIG, instance=n),
                                  Connection(peer="192.0.2.1"))
            for n in nodes}


def poll(node: str, status: NodeStatus) -> PollRequest:
    return PollRequest(v=1, node_id=node, credential=status.credential, known_round=-1, wait_s=60.0)


async def held(coord: Coordinator, count: int) -> None:
    for _ in range(1000):                          # yields until the polls are parked
        if coord.hub.open == count:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{coord.hub.open} polls held, expected {count}")


async def test_a_node_holds_at_most_its_cap_and_nodes_behind_one_address_are_all_held():
    coord = Coordinator(max_polls_per_node=2)
    await coord.start()
    try:
        status = await joined(coord, ["a", "b"])     # 2 of 3: no round yet, so polls are held
        tasks = [asyncio.ensure_future(coord.handle("j", poll(n, status[n]), Connection(peer="192.0.2.1")))
                 for n in ("a", "a", "b", "b")]      # one address, as behind NAT
        await held(coord, 4)
        with pytest.raises(RendezvousError) as refused:
            await coord.handle("j", poll("a", status["a"]), Connection(peer="192.0.2.7"))
        assert refused.value.code == ErrorCode.LIMIT_REACHED
        assert "--max-polls-per-node 2" in str(refused.value) and "'a'" in str(refused.value)
        assert coord.hub.open == 4               # the refused poll took nothing
        await joined(coord, ["c"])                 # the round forms: every held poll is answered
        answers = await asyncio.gather(*tasks)
        assert {s.assignment.round_id for s in answers if s.assignment} == {1} and len(answers) == 4
        assert coord.hub.per_node.held(("j", "a")) == 0 and coord.hub.per_peer.held("192.0.2.1") == 0
    finally:
        await coord.stop()


async def test_a_per_address_cap_applies_when_an_operator_sets_one():
    coord = Coordinator(max_polls_per_peer=1)
    await coord.start()
    try:
        status = await joined(coord, ["a", "b"])
        first = asyncio.ensure_future(coord.handle("j", poll("a", status["a"]), Connection(peer="192.0.2.1")))
        await held(coord, 1)
        with pytest.raises(RendezvousError) as refused:
            await coord.handle("j", poll("b", status["b"]), Connection(peer="192.0.2.1"))
        assert "--max-polls-per-peer 1" in str(refused.value)
        other = asyncio.ensure_future(coord.handle("j", poll("b", status["b"]), Connection(peer="192.0.2.2")))
        await held(coord, 2)                       # another address is held
        await joined(coord, ["c"])
        await asyncio.gather(first, other)
    finally:
        await coord.stop()


async def test_a_poll_refused_by_the_core_gives_back_what_it_took():
    coord = Coordinator(max_polls_per_node=1)
    await coord.start()
    try:
        status = await joined(coord, ["a", "b"])
        bad = PollRequest(v=1, node_id="a", credential="not-the-secret", known_round=-1, wait_s=60.0)
        for _ in range(3):
            with pytest.raises(RendezvousError):
                await coord.handle("j", bad, Connection(peer="192.0.2.1"))
        assert coord.hub.per_node.held(("j", "a")) == 0     # a forger cannot use up the node's cap
        task = asyncio.ensure_future(coord.handle("j", poll("a", status["a"]), Connection(peer="192.0.2.1")))
        await held(coord, 1)
        await joined(coord, ["c"])
        assert (await task).assignment is not None
    finally:
        await coord.stop()
