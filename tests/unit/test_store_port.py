"""A round's store port (rdzv_server/core/store_port.py): never the port of the last round its master ran the store
of, where that round's store may still listen; a round that would take it waits, with no assignments, for the
port its master's next poll gives. An agent that gives no port on polls (torchrun's plugin) is never waited for."""
from __future__ import annotations

import msgspec

from protocol.messages import (
    FailureReport,
    JobConfig,
    JoinRequest,
    LeaveRequest,
    NodeState,
    NodeStatus,
    PollRequest,
    WorkerFailure,
)
from rdzv_server.core.records import JobRecord
from rdzv_server.core.rendezvous import Rendezvous

CFG = JobConfig(min_nodes=2, max_nodes=2, max_restarts=5, last_call_s=0.0, lease_timeout_s=1e4)


def started(store: bool = True) -> Rendezvous:
    """Round 1 of nodes a (group rank 0, its join's port 29500) and b; `store`: a store per round (node-agent)."""
    rz = Rendezvous()
    for i, node in enumerate("ab"):
        rz.handle("j", JoinRequest(v=1, node_id=node, addr=f"10.0.0.{i + 1}", local_world_size=1,
                                   master_port=29500 + i, config=CFG, instance=node, store_per_round=store), 1.0)
    assert rz.jobs["j"].round is not None and rz.jobs["j"].round.members == ["a", "b"]
    return rz


def fail(rz: Rendezvous, now: float) -> None:
    r = rz.jobs["j"].round
    assert r is not None
    status = rz.handle("j", FailureReport(v=1, node_id="b", round_id=r.round_id,
                                          failures=[WorkerFailure(local_rank=0, rank=1, exitcode=1)]), now)
    assert status.accepted, status.reason


def poll(rz: Rendezvous, node: str, port: int, now: float) -> NodeStatus:
    return rz.handle("j", PollRequest(v=1, node_id=node, master_port=port, wait_s=0.0), now)


def port_of(status: NodeStatus) -> int | None:
    return status.assignment.master_port if status.assignment is not None else None


def test_a_round_formed_before_its_master_polls_again_waits_for_a_new_port():
    rz = started()
    poll(rz, "a", 30001, 2.0)
    fail(rz, 3.0)
    assert port_of(rz.view("j", "b", 3.0)) == 30001          # a newer port than round 1's: taken at once
    fail(rz, 4.0)                                            # before a polls again: 30001 is round 2's store's
    for node in "ab":
        view = rz.view("j", node, 4.0)
        assert view.node_state is NodeState.WAITING and view.assignment is None and view.round_id == 3
        assert view.reason == "round 3 waits for a new store port from its group rank 0 (a)"
    poll(rz, "b", 30500, 4.5)                                # not the master's port: nothing changes
    assert rz.view("j", "a", 4.5).assignment is None
    reply = poll(rz, "a", 30002, 5.0)
    assert reply.node_state is NodeState.MEMBER and port_of(reply) == 30002
    assert port_of(rz.view("j", "b", 5.0)) == 30002 and rz.jobs["j"].round.round_id == 3    # type: ignore[union-attr]


def test_after_a_restore_the_last_saved_port_is_not_taken_again():
    rz = started()
    poll(rz, "a", 30001, 2.0)
    fail(rz, 3.0)
    saved = msgspec.msgpack.encode(rz.jobs["j"])           # round 2, on port 30001
    poll(rz, "a", 30002, 3.5)                                # in memory only: ports are saved with rounds
    restored = Rendezvous({"j": msgspec.msgpack.decode(saved, type=JobRecord)})
    restored.restored(4.0, 0.5, clean=False)
    poll(restored, "a", 0, 4.05)                             # heard since the restore: b's failure counts at once
    fail(restored, 4.1)
    assert restored.view("j", "b", 4.1).assignment is None   # 30001 may still be round 2's store
    assert port_of(poll(restored, "a", 30003, 4.2)) == 30003


def test_an_agent_with_one_store_for_every_round_is_never_waited_for():
    rz = started(store=False)                                # torchrun's plugin: its agent store, every round
    poll(rz, "a", 0, 2.0)
    fail(rz, 3.0)
    fail(rz, 4.0)
    assert port_of(rz.view("j", "b", 4.0)) == 29500 and port_of(rz.view("j", "a", 4.0)) == 29500


def test_a_round_after_the_job_waited_is_checked_against_the_last_round_too():
    rz = started()
    rz.handle("j", LeaveRequest(v=1, node_id="b", reason="done here"), 2.0)     # below min_nodes: the job waits
    assert rz.jobs["j"].round is None and rz.jobs["j"].places == ["a", "b"]
    rz.handle("j", JoinRequest(v=1, node_id="c", addr="10.0.0.3", local_world_size=1, master_port=29600,
                               config=CFG, instance="c", store_per_round=True), 3.0)    # takes b's place
    assert rz.jobs["j"].round is not None and rz.view("j", "c", 3.0).assignment is None   # a: 29500 is round 1's
    assert port_of(poll(rz, "a", 30001, 3.5)) == 30001 and port_of(rz.view("j", "c", 3.5)) == 30001
