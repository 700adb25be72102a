"""The core hands its effects over in the outbox: what changed, what to wake, what to save, which
deadline came closer. Plain numbers for time; the shell's use of it is in test_coordinator_timer."""
from __future__ import annotations

from protocol.messages import FailureReport, JobConfig, JoinRequest, PollRequest, WorkerFailure
from rdzv_server.core.events import EventKind
from rdzv_server.core.rendezvous import Rendezvous

CFG = JobConfig(min_nodes=1, max_nodes=2, max_restarts=1, last_call_s=3.0, lease_timeout_s=5.0)


def join(rz: Rendezvous, node: str, now: float, addr: str = "10.0.0.1", instance: str = "i1") -> None:
    rz.handle("j", JoinRequest(v=1, node_id=node, addr=addr, local_world_size=1, master_port=1000, config=CFG,
                             instance=instance), now)


def test_a_new_job_hands_over_its_run_events_and_the_nearest_deadline():
    rz = Rendezvous()
    join(rz, "a", 10.0)
    out = rz.take_effects()
    assert out.new_runs == {"j"} and set(out.changed) == {"j"}
    assert [ev.kind for _, ev in out.events] == [EventKind.JOB_CREATED, EventKind.NODE_JOINED,
                                                 EventKind.ROUND_OPENED]
    assert out.earliest == 13.0                    # the last-call window, before the 15.0 lease
    assert rz.take_effects().events == []          # drained: nothing twice


def test_a_renewal_changes_nothing_saved_and_sets_no_earlier_deadline():
    rz = Rendezvous()
    join(rz, "a", 10.0)
    rz.take_effects()
    rz.handle("j", PollRequest(v=1, node_id="a", master_port=2000), 11.0)
    out = rz.take_effects()
    assert (out.events, out.woken, out.changed, out.earliest) == ([], set(), {}, None)


def test_a_repeated_join_with_a_new_address_is_a_change_to_save():
    rz = Rendezvous()
    join(rz, "a", 10.0)
    rz.take_effects()
    join(rz, "a", 11.0, addr="10.0.0.9")
    assert set(rz.take_effects().changed) == {"j"}
    join(rz, "a", 12.0, addr="10.0.0.9")           # the same again: nothing new
    assert rz.take_effects().changed == {}


def test_an_accepted_failure_is_one_restart_and_wakes_the_job_the_last_one_fails_it():
    rz = Rendezvous()
    join(rz, "a", 10.0)
    rz.tick(13.0)                                  # last call ends: round 1
    rz.take_effects()
    failure = WorkerFailure(local_rank=0, rank=0, exitcode=1)
    rz.handle("j", FailureReport(v=1, node_id="a", round_id=1, failures=[failure]), 14.0)
    out = rz.take_effects()
    assert out.restarts == ["j"] and out.woken == {"j"}
    assert failure.node_id == "" and failure.timestamp == 0.0     # what was handed in is not changed
    assert rz.jobs["j"].root_cause is not None and rz.jobs["j"].root_cause.node_id == "a"
    rz.handle("j", FailureReport(v=1, node_id="a", round_id=2, failures=[failure]), 15.0)
    out = rz.take_effects()
    assert out.restarts == [] and [ev.kind for _, ev in out.events][-1] == EventKind.JOB_FAILED
