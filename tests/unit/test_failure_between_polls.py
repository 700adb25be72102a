"""A member whose held poll was just answered holds no connection: its agent killed before it polls again (SIGKILL)
closes nothing, and its record looks alive for a lease. Its peers' workers fail at once (their collectives break),
and their failure must wait for it to be heard from (then counted) or lost, not spend the restart budget: CI saw a
spare's promotion count a restart this way. A healthy member polls again within milliseconds. Pure core."""
from __future__ import annotations

from protocol.messages import JobState, PollRequest
from rdzv_server.core.requests import Arrival
from tests.unit.test_rendezvous import JOB, cfg, fail, job, join, members, poll, running

SPARE_JOB = cfg(min_nodes=2, max_nodes=2, lease_timeout_s=3.0, last_call_s=0.0, max_restarts=3)


def holding(rz, nodes: str, now: float) -> None:
    """`nodes` hold a long-poll open from `now` (the connection is the lease meanwhile)."""
    for n in nodes:
        rz.handle(JOB, PollRequest(v=1, node_id=n), now, Arrival(hold=True))


def test_a_member_killed_between_polls_is_lost_and_its_spare_takes_the_place_with_no_restart_counted():
    rz = running(["a", "b"], SPARE_JOB)
    join(rz, "c", 1.0, SPARE_JOB)                # a spare (the job is at max_nodes)
    first = job(rz).round.round_id
    holding(rz, "abc", 4.9)
    rz.poll_ended(JOB, "b", 5.0, heard_at=5.0)   # b's poll answered: b is killed before it polls again
    fail(rz, "a", first, 5.05)                   # a's collective broke
    assert job(rz).restart_count == 0 and job(rz).round.round_id == first
    assert job(rz).held_failure is not None and job(rz).held_failure.waiting_for == ["b"]
    for t in (5.5, 6.0, 6.5, 7.0, 7.5, 8.0):       # the others' held polls' keepalives (the shell tells them)
        rz.heard(t)
    rz.tick(5.0 + 3.0 + 0.1)                     # b's lease lapsed
    assert "b" not in job(rz).nodes and job(rz).restart_count == 0 and job(rz).state == JobState.RUNNING
    assert job(rz).round.round_id > first and sorted(members(rz)) == ["a", "c"]
    assert not [e for e in job(rz).events if e.kind == "worker_failed"]


def test_the_failure_counts_once_the_answered_member_polls_again():
    rz = running(["a", "b", "c"], cfg(min_nodes=3, max_nodes=3, lease_timeout_s=3.0, last_call_s=0.0))
    first = job(rz).round.round_id
    holding(rz, "abc", 2.0)
    rz.poll_ended(JOB, "b", 5.0, heard_at=5.0)
    rz.poll_ended(JOB, "c", 5.0, heard_at=5.0)
    fail(rz, "a", first, 5.01)                   # a failure of a's own
    assert job(rz).restart_count == 0
    poll(rz, "b", 5.02)
    assert job(rz).restart_count == 0            # c not heard from yet
    poll(rz, "c", 5.03)
    assert job(rz).restart_count == 1 and job(rz).held_failure is None and job(rz).round.round_id == first + 1
    assert any(e.kind == "worker_failed" and e.node_id == "a" for e in job(rz).events)


def test_a_failure_counts_at_once_while_every_other_member_holds_a_poll():
    rz = running(["a", "b"], SPARE_JOB)
    first = job(rz).round.round_id
    holding(rz, "ab", 2.0)
    rz.poll_ended(JOB, "b", 5.0, heard_at=5.0)
    holding(rz, "b", 5.001)                      # b polls again at once, as a healthy agent does
    fail(rz, "a", first, 5.05)
    assert job(rz).restart_count == 1 and job(rz).held_failure is None and job(rz).round.round_id == first + 1
