"""Node credentials in the core: only the agent that joined may act for its node; a live node's id
cannot be taken; a dead node's restarted agent gets back in; a refusal changes nothing."""
from __future__ import annotations

import pytest

from protocol.errors import ErrorCode
from protocol.messages import (
    FailureReport,
    JobConfig,
    JoinRequest,
    LeaveRequest,
    PollRequest,
    SuccessReport,
    WorkerFailure,
)
from rdzv_server.core.rendezvous import Rendezvous, RendezvousError
from rdzv_server.core.requests import Arrival
from rdzv_server.core.rounds import assignment

CFG = JobConfig(min_nodes=2, max_nodes=2, max_restarts=3, last_call_s=0.0, lease_timeout_s=5.0)


def join(rz: Rendezvous, node: str, now: float, secret: str, sent: str = "", addr: str = "10.0.0.1"):
    return rz.handle("j", JoinRequest(v=1, node_id=node, addr=addr, local_world_size=1, master_port=1000,
                                    config=CFG, credential=sent, instance=secret), now, Arrival(secret=secret))


def snapshot(rz: Rendezvous) -> tuple:
    job = rz.jobs["j"]
    return job.epoch, job.event_seq, job.restart_count, job.round and job.round.round_id, \
        {n: (r.addr, r.last_seen, r.credential_digest) for n, r in job.nodes.items()}


@pytest.fixture
def running() -> Rendezvous:
    rz = Rendezvous()
    assert join(rz, "a", 1.0, "secret-a").credential == "secret-a"   # the reply hands the secret over once
    assert join(rz, "b", 1.0, "secret-b").assignment is not None
    assert join(rz, "a", 1.5, "another", sent="secret-a").credential == ""   # its own rejoin: no new secret
    return rz


def forged(node: str, credential: str) -> list:
    failure = WorkerFailure(local_rank=0, rank=0, exitcode=1)
    return [PollRequest(v=1, node_id=node, credential=credential),
            FailureReport(v=1, node_id=node, credential=credential, round_id=1, failures=[failure]),
            SuccessReport(v=1, node_id=node, credential=credential, round_id=1),
            LeaveRequest(v=1, node_id=node, credential=credential)]


@pytest.mark.parametrize("credential, code", [("", ErrorCode.UNAUTHORIZED), ("secret-b", ErrorCode.FORBIDDEN),
                                              ("guess", ErrorCode.FORBIDDEN)])
def test_requests_for_a_node_without_its_credential_are_refused_and_change_nothing(running, credential, code):
    before = snapshot(running)
    for req in forged("a", credential):      # a poll, a failure, a success and a leave
        with pytest.raises(RendezvousError) as err:
            running.handle("j", req, 2.0)
        assert err.value.code == code
    assert snapshot(running) == before


def test_a_report_refused_after_its_credential_checked_still_changes_nothing(running):
    """Found by the route fuzzer: a failure report with the right credential but a local rank the
    node does not run was refused, yet noted the credential as used (the lost-join-reply rule reads it)."""
    node = running.jobs["j"].nodes["b"]
    assert not node.credential_used
    bad = FailureReport(v=1, node_id="b", credential="secret-b", round_id=1,
                        failures=[WorkerFailure(local_rank=1, rank=1, exitcode=1)])
    with pytest.raises(RendezvousError) as err:
        running.handle("j", bad, 2.0)
    assert err.value.code == ErrorCode.BAD_REQUEST and not node.credential_used
    running.handle("j", SuccessReport(v=1, node_id="b", credential="secret-b", round_id=1), 2.0)
    assert node.credential_used                  # an accepted request still proves it


def test_a_live_nodes_id_cannot_be_taken_and_the_attempt_changes_nothing(running):
    before = snapshot(running)
    with pytest.raises(RendezvousError) as err:
        join(running, "a", 3.0, "thief", addr="6.6.6.6")
    assert err.value.code == ErrorCode.NODE_CONFLICT and "another node id" in err.value.message
    assert snapshot(running) == before
    assert assignment(running.jobs["j"].round, "a").master_addr == "10.0.0.1"


@pytest.mark.parametrize("how", ["lease lapsed", "connection closed"])
def test_a_dead_nodes_restarted_agent_gets_back_in_and_the_old_credential_is_dead(running, how):
    if how == "lease lapsed":
        now = 1.5 + CFG.lease_timeout_s        # a's lease ran out (no tick yet)
    else:
        running.connection_dropped("j", "a", 2.0)
        now = 2.1                              # still inside the drop grace
    status = join(running, "a", now, "secret-a2")
    assert status.credential == "secret-a2"
    assert any(e.kind == "node_lost" and "restarted" in e.message for e in running.jobs["j"].events[-6:])
    with pytest.raises(RendezvousError) as err:                 # the old agent, if it wakes up
        running.handle("j", PollRequest(v=1, node_id="a", credential="secret-a"), now + 0.1)
    assert err.value.code == ErrorCode.FORBIDDEN and "took the node over" in err.value.message
