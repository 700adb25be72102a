"""A join committed but whose reply (with the node's secret) was lost, because the server was killed
or another replica took over in between: the same agent joining again gets the node back with a
fresh secret, and the secret it never saw is dead. Another agent still cannot take a live node."""
from __future__ import annotations

import pytest

from protocol.errors import ErrorCode
from protocol.messages import JobConfig, JoinRequest, PollRequest
from rdzv_server.core.rendezvous import Rendezvous, RendezvousError
from rdzv_server.core.requests import Arrival

CFG = JobConfig(min_nodes=2, max_nodes=2, last_call_s=0.0, lease_timeout_s=5.0)


def join(rz: Rendezvous, node: str, now: float, secret: str, instance: str, sent: str = ""):
    return rz.handle("j", JoinRequest(v=1, node_id=node, addr="10.0.0.1", local_world_size=1, master_port=1,
                                    config=CFG, credential=sent, instance=instance), now, Arrival(secret=secret))


def test_the_same_agent_joining_without_the_lost_secret_gets_a_fresh_one():
    rz = Rendezvous()
    join(rz, "a", 1.0, "never-seen", instance="agent-a-1")        # the reply with "never-seen" is lost
    again = join(rz, "a", 1.2, "fresh", instance="agent-a-1")
    assert again.credential == "fresh" and len(rz.jobs["j"].nodes) == 1
    assert not any(e.kind == "node_lost" for e in rz.jobs["j"].events)
    rz.handle("j", PollRequest(v=1, node_id="a", credential="fresh"), 1.3)
    with pytest.raises(RendezvousError) as err:
        rz.handle("j", PollRequest(v=1, node_id="a", credential="never-seen"), 1.3)
    assert err.value.code == ErrorCode.FORBIDDEN


def test_another_agent_still_cannot_take_a_live_node_without_its_secret():
    rz = Rendezvous()
    join(rz, "a", 1.0, "secret-a", instance="agent-a-1")
    with pytest.raises(RendezvousError) as err:
        join(rz, "a", 1.2, "thief", instance="agent-x-9")
    assert err.value.code == ErrorCode.NODE_CONFLICT
    with pytest.raises(RendezvousError) as err:
        join(rz, "a", 1.2, "thief", instance="")
    assert err.value.code == ErrorCode.NODE_CONFLICT


def test_a_late_duplicate_of_the_join_cannot_take_the_node_from_its_agent():
    """After a partition heals, a join the agent sent and abandoned may still be delivered (the same
    instance, no secret). Once the agent has used its secret, that duplicate is refused and the
    agent's secret stays good."""
    rz = Rendezvous()
    join(rz, "a", 1.0, "secret-a", instance="agent-a-1")
    rz.handle("j", PollRequest(v=1, node_id="a", credential="secret-a"), 1.1)      # the agent has it
    with pytest.raises(RendezvousError) as err:
        join(rz, "a", 1.2, "from-the-duplicate", instance="agent-a-1")
    assert err.value.code == ErrorCode.NODE_CONFLICT
    rz.handle("j", PollRequest(v=1, node_id="a", credential="secret-a"), 1.3)
    with pytest.raises(RendezvousError) as err:
        rz.handle("j", PollRequest(v=1, node_id="a", credential="from-the-duplicate"), 1.3)
    assert err.value.code == ErrorCode.FORBIDDEN


def test_the_join_event_names_the_address_the_connection_came_from_beside_the_one_the_node_gave():
    """`addr` is what the node says (where others reach it); a stranger's claim shows beside the real source."""
    rz = Rendezvous()
    rz.handle("j", JoinRequest(v=1, node_id="a", addr="10.0.0.1", local_world_size=1, master_port=1, config=CFG,
                               instance="i"), 1.0, Arrival(secret="s", peer="192.0.2.7", local="192.0.2.1"))
    rz.handle("j", JoinRequest(v=1, node_id="b", addr="192.0.2.8", local_world_size=1, master_port=1, config=CFG,
                               instance="j"), 1.0, Arrival(secret="t", peer="192.0.2.8", local="192.0.2.1"))
    rz.handle("j", JoinRequest(v=1, node_id="c", addr="192.0.2.9", local_world_size=1, master_port=1, config=CFG,
                               instance="k"), 1.0, Arrival(secret="u", peer="::ffff:192.0.2.9", local="::"))
    joined = [e.message for e in rz.jobs["j"].events if e.kind == "node_joined"]
    assert joined == ["node a joined from 10.0.0.1 (connected from 192.0.2.7) with 1 workers",
                      "node b joined from 192.0.2.8 with 1 workers", "node c joined from 192.0.2.9 with 1 workers"]
