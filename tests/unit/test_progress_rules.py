"""The server's rules for progress (core/progress_rules.py), through the real Rendezvous: a refused report
changes no progress, a node named slow is named only while it is a member, and a slow node of a job with no
snapshot is swapped for a spare at once (tests/unit/test_swaps.py: at a snapshot)."""
from __future__ import annotations

import msgspec
import pytest

from protocol.messages import FailureReport, JobState, LeaveRequest, PollRequest, SuccessReport, WorkerFailure
from protocol.notes import CopiesNote
from rdzv_server.core.errors import RendezvousError
from rdzv_server.core.events import EventKind
from rdzv_server.core.rendezvous import Rendezvous
from tests.unit.progress_jobs import CFG, T, crash, join, note, poll, restarting, slow, step, stepping


def test_a_refused_failure_report_changes_no_progress() -> None:
    rz = Rendezvous()
    slow(rz)
    job = rz.jobs["lagging"]
    before = msgspec.json.encode(job.progress)
    round_id = job.round.round_id
    bad = WorkerFailure(local_rank=7, rank=7, exitcode=1, timestamp=T + 90)      # node b runs local ranks 0-1
    with pytest.raises(RendezvousError):
        rz.handle("lagging", FailureReport(v=1, node_id="b", credential="secret-b", round_id=round_id,
                                                   failures=[bad], progress=note(round_id, 500, T + 5, T + 90)), T + 90)
    assert msgspec.json.encode(job.progress) == before and job.round.round_id == round_id
    assert job.restart_count == 0


def test_a_slow_node_that_left_is_no_longer_named() -> None:
    rz = Rendezvous()
    slow(rz)
    rz.handle("lagging", LeaveRequest(v=1, node_id="b", credential="secret-b", reason="maintenance"), T + 100)
    join(rz, "lagging", "c", T + 101)
    job = rz.jobs["lagging"]
    assert sorted(job.round.members) == ["a", "c"]
    poll(rz, "lagging", "a", T + 110, note(job.round.round_id, 10, T + 105, T + 110))
    assert job.progress.slow == []


@pytest.mark.parametrize("memoryless", [False, True])
def test_a_slow_node_of_a_job_with_no_snapshot_is_swapped_for_the_spare_at_once(memoryless) -> None:
    """Also where b runs --no-memory-dir: its note says it holds nothing and copies nothing, and it has no copy port
    (a review: the swap waited for a snapshot that never comes, and the ranks held after theirs meanwhile)."""
    rz = Rendezvous()
    config = msgspec.structs.replace(CFG, replace_slow_nodes=True)
    for node in ("a", "b", "c"):                 # c: a hot spare of a 2-node job
        join(rz, "swap", node, T, config)
    job = rz.jobs["swap"]
    assert "c" in job.spares
    round_id = job.round.round_id
    for i in range(1, 9):
        at = T + 10 * i
        poll(rz, "swap", "a", at, note(round_id, 20 * i, T + 5, at, demand=0.33))
        if memoryless:       # a holds snapshots, b none
            for n, held in (("a", 10 * i), ("b", -1)):
                rz.handle("swap", PollRequest(v=1, node_id=n, credential=f"secret-{n}", known_round=round_id,
                                              wait_s=0.0, copies=CopiesNote(local_step=held, copying=False)), at)
        poll(rz, "swap", "b", at, note(round_id, 20 * i, T + 5, at, demand=0.98))
        if job.round.round_id != round_id:
            break
    assert job.round.members == ["a", "c"] and job.restart_count == 0 and "b" in job.excluded
    swapped = [e for e in job.events if e.kind == EventKind.NODE_SUSPECT and "swapped for spare c" in e.message]
    assert len(swapped) == 1 and "no snapshot to wait for" in swapped[0].message, swapped


def test_a_pace_from_the_round_before_is_no_measure_in_the_next() -> None:
    rz = Rendezvous()
    join(rz, "paced", "a", T)
    join(rz, "paced", "b", T)
    job = rz.jobs["paced"]
    poll(rz, "paced", "a", T + 10, note(job.round.round_id, 20, T + 1, T + 10, demand=0.2))   # a waited on b
    crash(rz, "paced", "b", T + 11)
    poll(rz, "paced", "a", T + 12, None)
    assert job.round.round_id == 2
    for at in (T + 14, T + 15):     # round 2: only b has stepped yet; a's pace of round 1 is no peer's
        poll(rz, "paced", "b", at, note(2, 20, T + 13, at, demand=0.95))
    assert job.progress.slow == [] and not [e for e in job.events if e.kind == EventKind.NODE_SLOW]


def test_a_restart_whose_round_ran_only_until_its_success_reports_is_counted() -> None:
    rz = Rendezvous()
    join(rz, "short", "a", T)
    join(rz, "short", "b", T)
    job = rz.jobs["short"]
    poll(rz, "short", "a", T + 10, note(1, 20, T + 1, T + 10))
    crash(rz, "short", "b", T + 11)
    poll(rz, "short", "a", T + 12, None)
    for node in ("a", "b"):                   # round 2 stepped from T+13; its notes come with the successes only
        rz.handle("short", SuccessReport(v=1, node_id=node, credential=f"secret-{node}", round_id=2,
                                                 progress=note(2, 5, T + 13, T + 14)), T + 15)
    assert job.state == JobState.SUCCEEDED
    assert job.progress.restarts == 1 and job.progress.lost_s == pytest.approx(3.0)


def test_a_job_that_swaps_slow_nodes_on_gpus_is_told_once_that_a_slow_gpu_is_not_seen() -> None:
    rz = Rendezvous()
    swapping = msgspec.structs.replace(CFG, replace_slow_nodes=True)
    for job, config in (("gpus", swapping), ("gpus-no-swap", CFG), ("cpus", swapping)):
        join(rz, job, "a", T, config)
        join(rz, job, "b", T, config)
    for i in range(1, 4):
        at = T + 10 * i
        for job in ("gpus", "gpus-no-swap", "cpus"):
            round_id = rz.jobs[job].round.round_id
            for node in ("a", "b"):
                told = note(round_id, 20 * i, T + 5, at)
                poll(rz, job, node, at, msgspec.structs.replace(told, on_device=job != "cpus"))

    def unseen(job: str) -> list[str]:
        return [e.message for e in rz.jobs[job].events if e.kind == EventKind.PACE_UNSEEN]
    said = unseen("gpus")
    assert len(said) == 1 and "GPU is not named" in said[0] and "--replace-slow-nodes" in said[0], said
    assert unseen("gpus-no-swap") == [] and unseen("cpus") == []


def test_a_restart_that_trains_steps_again_says_how_many_once_and_one_of_unknown_resume_says_nothing() -> None:
    rz = Rendezvous()
    stepping(rz)                             # reached 180, resumed from 150
    redone = [(e.message, e.round_id) for e in rz.jobs["train"].events if e.kind == EventKind.WORK_REDONE]
    assert redone == [("round 2 resumed from step 150 after the job had reached step 180: 30 step(s) are trained "
                       "again", 2)]
    restarting(rz)                           # a script without snapshots: it tells no resumed step
    step(rz, "again", ["a", "b"], T + 70, T + 80, 10, T + 80)
    job = rz.jobs["again"]
    assert job.progress.restarts == 1 and not [e for e in job.events if e.kind == EventKind.WORK_REDONE]


def test_a_job_sent_back_to_step_0_says_so() -> None:
    rz = Rendezvous()
    restarting(rz)                           # reached 80 (from scratch), then a crash
    step(rz, "again", ["a", "b"], T + 70, T + 80, 10, T + 80, resumed=0)
    assert [e.message for e in rz.jobs["again"].events if e.kind == EventKind.WORK_REDONE] == [
        "round 2 resumed from step 0 after the job had reached step 80: 80 step(s) are trained again"]
