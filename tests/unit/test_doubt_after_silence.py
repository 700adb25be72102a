"""A failure reported as an outage of the server's own ends (its link cut, its loop stalled: Arrival.outage, which
the shell tells) waits for the members not heard from since (leases.doubted): a member's agent killed in it breaks
its peers' collectives, and their reports can be read before its close or its new agent's join. Counted at once, a
default job (max_restarts 0) failed; a review saw it. Pure core, time as plain floats."""
from __future__ import annotations

from protocol.messages import FailureReport, JobState, PollRequest, WorkerFailure
from rdzv_server.core.leases import DROP_GRACE_S, QUIET_S, SETTLE_S
from rdzv_server.core.requests import Arrival
from tests.unit.test_rendezvous import JOB, cfg, job, join, members, poll, running

FIXED = cfg(min_nodes=3, max_nodes=3, lease_timeout_s=5.0, last_call_s=0.0, max_restarts=0)


def fail(rz, node: str, round_id: int, now: float, outage: tuple[float, float] | None) -> None:
    """`node` reports a worker failure of `round_id`, read at `now`, the server's last outage `outage`."""
    failure = WorkerFailure(local_rank=0, rank=0, exitcode=1)
    rz.handle(JOB, FailureReport(v=1, node_id=node, round_id=round_id, failures=[failure]), now,
              Arrival(outage=outage))


def holding(rz, nodes: str, now: float) -> None:
    """`nodes` hold a long-poll open from `now` (the connection is the lease meanwhile)."""
    for n in nodes:
        rz.handle(JOB, PollRequest(v=1, node_id=n), now, Arrival(hold=True))


def test_a_failure_read_after_a_silence_waits_for_a_member_whose_agent_died_in_it():
    rz = running(["a", "b", "c"], FIXED)
    first = job(rz).round.round_id
    holding(rz, "abc", 10.0)
    end = 10.0 + QUIET_S + 1.0                          # the server's link cut (or its loop stalled) till then
    fail(rz, "a", first, end, (10.0, end))              # b's workers died with its agent: a's broke
    fail(rz, "c", first, end + 0.05, (10.0, end))
    assert job(rz).state == JobState.RUNNING and job(rz).restart_count == 0 and job(rz).round.round_id == first
    assert job(rz).held_failure is not None and job(rz).nodes["b"].unheard
    rz.connection_dropped(JOB, "b", end + 0.3, heard=True)     # b's FIN, read at last
    rz.tick(end + 0.3 + DROP_GRACE_S)
    assert "b" not in job(rz).nodes and job(rz).state != JobState.FAILED and job(rz).restart_count == 0
    join(rz, "b", end + 2.0, FIXED, instance="b#2")      # its new agent
    assert members(rz) == ["a", "b", "c"] and job(rz).restart_count == 0 and job(rz).state == JobState.RUNNING


def test_the_failure_counts_once_the_member_in_doubt_is_heard_from():
    rz = running(["a", "b", "c"], cfg(min_nodes=3, max_nodes=3, lease_timeout_s=5.0, last_call_s=0.0, max_restarts=3))
    first = job(rz).round.round_id
    holding(rz, "abc", 10.0)
    end = 10.0 + QUIET_S + 1.0
    fail(rz, "a", first, end, (10.0, end))
    assert job(rz).restart_count == 0
    poll(rz, "b", end + 0.5)
    assert job(rz).restart_count == 0                   # c is not heard from yet
    poll(rz, "c", end + 0.6)
    assert job(rz).restart_count == 1 and job(rz).held_failure is None and job(rz).round.round_id == first + 1


def test_a_failure_with_no_outage_or_well_after_one_counts_at_once():
    """No member is doubted without an outage the shell saw, nor by a report read SETTLE_S after one ended: a
    failure's restart is not delayed."""
    for outage, at in ((None, 30.0), ((10.0, 15.0), 15.0 + SETTLE_S + 0.5)):
        rz = running(["a", "b", "c"], cfg(min_nodes=3, max_nodes=3, lease_timeout_s=30.0, last_call_s=0.0,
                                          max_restarts=3))
        first = job(rz).round.round_id
        holding(rz, "abc", 10.0)
        fail(rz, "a", first, at, outage)
        assert job(rz).restart_count == 1 and job(rz).round.round_id == first + 1, outage
        assert not any(n.unheard for n in job(rz).nodes.values())
