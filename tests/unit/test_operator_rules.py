"""Operator actions on the pure core: close, drain, clear an exclusion or drain, resize."""
from __future__ import annotations

import pytest

from protocol.errors import ErrorCode
from protocol.messages import JobConfig, JobState, NodeState
from rdzv_server.core.records import JobRecord
from rdzv_server.core.rendezvous import Rendezvous, RendezvousError
from tests.unit.test_rendezvous import JOB, cfg, fail, join, poll


def running(nodes=("a", "b"), **kw) -> Rendezvous:
    rz = Rendezvous()
    c = cfg(min_nodes=len(nodes), max_nodes=len(nodes), last_call_s=0.0, **kw)
    for i, n in enumerate(nodes):
        join(rz, n, float(i), c)
    assert rz.jobs[JOB].state == JobState.RUNNING
    return rz


def test_close_ends_the_job_and_tells_every_node():
    rz = running()
    rz.close_job(JOB, "maintenance", 5.0)
    status = poll(rz, "a", 6.0)
    assert status.job_state == JobState.CLOSED and "closed by operator: maintenance" in status.reason
    with pytest.raises(RendezvousError) as err:
        rz.close_job(JOB, "again", 7.0)
    assert err.value.code == ErrorCode.JOB_FINISHED


def test_drain_reforms_without_the_node_uses_no_restart_and_keeps_it_out_until_cleared():
    rz = running(("a", "b", "c"))
    job = rz.jobs[JOB]
    rz.resize(JOB, 1, 3, 3.0)
    rz.drain_node(JOB, "b", "bad disk", 4.0)
    assert job.round.members == ["a", "c"] and job.restart_count == 0
    assert job.events[-1].data["cause"] == "node_drained"
    assert poll(rz, "b", 5.0).node_state == NodeState.GONE
    with pytest.raises(RendezvousError) as err:
        join(rz, "b", 6.0, cfg(min_nodes=3, max_nodes=3, last_call_s=0.0), instance="b#2")
    assert err.value.code == ErrorCode.NODE_DRAINED and "bad disk" in err.value.message
    rz.clear_exclusion(JOB, "b", 7.0)
    join(rz, "b", 8.0, cfg(min_nodes=3, max_nodes=3, last_call_s=0.0), instance="b#2")
    assert "b" in job.nodes and job.nodes["b"].state in (NodeState.WAITING, NodeState.MEMBER)


def test_a_drained_spare_hears_it_was_drained_not_the_jobs_older_news():
    # A spare's drain forms no round, so the job's reason is older news (a review: the drained spare's agent
    # said "rejoining ... (job j: worker failure on b ...)"): its status says the drain.
    rz = running()
    join(rz, "c", 3.0, cfg(min_nodes=2, max_nodes=2, last_call_s=0.0))
    assert rz.jobs[JOB].spares == ["c"]
    rz.drain_node(JOB, "c", "flaky NIC", 4.0)
    status = poll(rz, "c", 5.0)
    assert status.node_state == NodeState.GONE and status.reason == "node c drained by operator: flaky NIC"


def test_a_node_not_in_the_job_can_be_drained_ahead():
    rz = running()
    rz.drain_node(JOB, "ghost", "known bad", 3.0)
    with pytest.raises(RendezvousError) as err:
        join(rz, "ghost", 4.0, cfg(min_nodes=2, max_nodes=2, last_call_s=0.0))
    assert err.value.code == ErrorCode.NODE_DRAINED
    assert rz.jobs[JOB].round.round_id == 1          # nothing else changed


def test_clear_exclusion_readmits_at_once_and_forgets_the_history():
    rz = running(("a", "b"), exclude_after=1, max_restarts=5)
    rz.resize(JOB, 1, 2, 2.0)
    fail(rz, "b", rz.jobs[JOB].round.round_id, 3.0)
    job = rz.jobs[JOB]
    assert job.excluded == ["b"]
    rz.clear_exclusion(JOB, "b", 4.0)
    assert job.excluded == [] and job.nodes["b"].failure_times == [] and job.nodes["b"].exclusions == 0
    with pytest.raises(RendezvousError) as err:
        rz.clear_exclusion(JOB, "a", 5.0)
    assert err.value.code == ErrorCode.NOT_FOUND


def test_resize_down_to_members_turns_waiting_nodes_into_spares_without_a_new_round():
    rz = Rendezvous()
    c = cfg(min_nodes=2, max_nodes=4, last_call_s=10.0)
    join(rz, "a", 0.0, c)
    join(rz, "b", 0.0, c)
    rz.tick(10.0)                                   # round 1 with a, b
    join(rz, "c", 11.0, c)                          # waits for a last call (scale-up)
    job = rz.jobs[JOB]
    assert job.waiting == ["c"] and job.last_call_deadline is not None
    rz.resize(JOB, 2, 2, 12.0)
    assert job.round.round_id == 1 and job.spares == ["c"] and job.last_call_deadline is None
    assert job.nodes["c"].state == NodeState.SPARE
    assert rz.tick(30.0) == [] and job.round.round_id == 1


def test_resize_checks_its_numbers_and_keeps_joins_matching_the_start_config():
    rz = running(("a", "b"))
    with pytest.raises(RendezvousError) as err:
        rz.resize(JOB, 3, 2, 2.0)
    assert err.value.code == ErrorCode.BAD_REQUEST and "max_nodes" in err.value.message
    rz.resize(JOB, 1, 1, 3.0)
    job = rz.jobs[JOB]
    assert len(job.round.members) == 1 and job.spares == ["b"] and job.restart_count == 0
    # a restarted agent joins with the flags it started with: that is not a config conflict
    join(rz, "b", 4.0, cfg(min_nodes=2, max_nodes=2, last_call_s=0.0), instance="b#2")
    assert job.spares == ["b"]


def b_failed_and_excluded() -> tuple[Rendezvous, JobConfig, JobRecord]:
    """a, b, c in a 2:3 job that excludes after one failure; b has failed (the job goes on with a and c)."""
    rz = Rendezvous()
    c = cfg(min_nodes=2, max_nodes=3, last_call_s=0.0, exclude_after=1, max_restarts=5)
    for n in ("a", "b", "c"):
        join(rz, n, 0.0, c)
    job = rz.jobs[JOB]
    fail(rz, "b", job.round.round_id, 1.0)
    return rz, c, job


def test_clearing_the_exclusion_of_a_node_whose_agent_is_gone_forms_no_round_with_it():
    """A review: b excluded after a failure, its agent killed (to be started again, repaired), the operator clears
    the exclusion before the server gave the closed connection up. b was readmitted as ready and a round of 3
    formed at once with no agent behind it: a and c stopped their workers for it, and again a moment later when b
    was lost. Its record now goes (its next agent joins afresh, not excluded); the running round stays."""
    rz, c, job = b_failed_and_excluded()
    assert job.excluded == ["b"] and job.round.members == ["a", "c"]
    running_round = job.round.round_id
    rz.connection_dropped(JOB, "b", 2.0, heard=True)      # its agent killed
    rz.clear_exclusion(JOB, "b", 2.1)
    assert job.round.round_id == running_round and job.round.members == ["a", "c"]
    assert "b" not in job.nodes and job.excluded == [] and job.restart_count == 1
    rz.tick(5.0)
    assert job.round.round_id == running_round
    join(rz, "b", 6.0, c, instance="b#2")                   # its next agent: admitted, not excluded
    assert job.nodes["b"].state in (NodeState.WAITING, NodeState.MEMBER) and job.excluded == []


def test_clearing_the_exclusion_of_a_node_whose_agent_waits_readmits_it():
    rz, c, job = b_failed_and_excluded()
    poll(rz, "b", 1.5)
    rz.clear_exclusion(JOB, "b", 2.0)
    assert "b" in job.round.members and job.restart_count == 1


def test_draining_a_drained_node_again_keeps_the_first_drains_reason():
    # A review: a second drain answered "drained" again and replaced the reason in the drained list, while the
    # job's reason (and its agent's refusals' first word) kept the first: the first drain stands, as a no-op.
    rz = running(("a", "b", "c"))
    rz.resize(JOB, 2, 3, 2.0)
    job = rz.jobs[JOB]
    rz.drain_node(JOB, "b", "bad disk", 3.0)
    events, round_id = job.event_seq, job.round.round_id
    rz.drain_node(JOB, "b", "flaky NIC", 4.0)
    assert job.drained == {"b": "bad disk"} and "bad disk" in job.reason
    assert job.event_seq == events and job.round.round_id == round_id        # nothing else changed
    with pytest.raises(RendezvousError) as err:
        join(rz, "b", 5.0, cfg(min_nodes=3, max_nodes=3, last_call_s=0.0), instance="b#2")
    assert "bad disk" in err.value.message and "flaky NIC" not in err.value.message
