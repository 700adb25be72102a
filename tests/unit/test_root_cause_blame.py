"""A worker crash on one node breaks every node's collective, so both agents report a failure; whichever report
arrives first fails the round. The root cause is the earliest failure by its timestamp: when the healthy node's
report (its collective broke later) arrives first, the crashed node's later report takes over the round's count
toward --exclude-after, the exclusion it wrongly caused, and the root cause the job's events name."""
from __future__ import annotations

import msgspec
import pytest

from protocol.messages import (
    FailureReport,
    JobConfig,
    JobState,
    JoinRequest,
    LeaveRequest,
    NodeState,
    PollRequest,
    WorkerFailure,
)
from rdzv_server.core import alone
from rdzv_server.core.rendezvous import Rendezvous

JOB = "job-1"
CFG = JobConfig(min_nodes=1, max_nodes=2, max_restarts=100, exclude_after=2, exclude_window_s=600.0,
                exclude_cooldown_s=60.0, lease_timeout_s=10_000.0)


def running(exclude_after: int = 2) -> Rendezvous:
    rz, config = Rendezvous(), msgspec.structs.replace(CFG, exclude_after=exclude_after)
    for i, n in enumerate(("a", "b")):
        rz.handle(JOB, JoinRequest(v=1, node_id=n, addr=f"addr-{n}", local_world_size=1, master_port=20000 + i,
                                   config=config, instance=f"{n}#1"), i * 0.01)
    assert list(rz.jobs[JOB].round.members) == ["a", "b"]
    return rz


def report(rz: Rendezvous, node: str, round_id: int, now: float, at: float, message: str) -> None:
    failure = WorkerFailure(local_rank=0, rank=0 if node == "a" else 1, exitcode=1, message=message, timestamp=at)
    rz.handle(JOB, FailureReport(v=1, node_id=node, round_id=round_id, failures=[failure]), now)


def a_then_b(rz: Rendezvous, r: int, a_came: float, a_at: float, b_came: float, b_at: float) -> None:
    """a's crash reported first, then b's broken collective, in round `r` (arrival, then stamp, of each)."""
    report(rz, "a", r, a_came, a_at, "ValueError: bad batch")
    report(rz, "b", r, b_came, b_at, "RuntimeError: [gloo] Connection closed by peer")


def crash_on_a_reported_by_b_first(rz: Rendezvous, now: float) -> int:
    """a's worker crashes at `now`; b's dies of the broken collective 0.5 s later; b's report arrives first."""
    r = rz.jobs[JOB].round.round_id
    report(rz, "b", r, now + 1.0, now + 0.5, "RuntimeError: [gloo] Connection closed by peer")
    report(rz, "a", r, now + 1.2, now, "ValueError: bad batch")
    return r


def test_the_crashed_nodes_late_report_takes_the_count_and_is_named_the_root_cause():
    rz = running()
    r = crash_on_a_reported_by_b_first(rz, 10.0)
    job = rz.jobs[JOB]
    assert job.root_cause is not None and job.root_cause.node_id == "a"
    assert job.last_failure is not None and job.last_failure.node_id == "a"
    assert job.nodes["b"].failure_times == [] and len(job.nodes["a"].failure_times) == 1
    assert job.restart_count == 1                              # one failed round, one restart
    named = [e for e in job.events if e.kind == "worker_failed" and e.node_id == "a" and e.round_id == r]
    assert named and "root cause" in named[-1].message and "node a" in named[-1].message, named


def test_the_healthy_node_is_not_excluded_for_crashes_on_the_other():
    rz = running()
    crash_on_a_reported_by_b_first(rz, 10.0)
    crash_on_a_reported_by_b_first(rz, 20.0)    # b's second first-report would have excluded it (exclude_after=2)
    job = rz.jobs[JOB]
    assert job.nodes["b"].state != NodeState.EXCLUDED and job.nodes["b"].exclusions == 0
    assert job.excluded == ["a"] and job.nodes["a"].exclusions == 1
    assert job.round is not None and list(job.round.members) == ["b"]


def test_an_exclusion_the_first_report_caused_moves_to_the_root_causes_node():
    rz = running(exclude_after=1)
    crash_on_a_reported_by_b_first(rz, 10.0)
    job = rz.jobs[JOB]
    assert job.nodes["b"].state != NodeState.EXCLUDED and job.nodes["b"].exclusions == 0
    assert job.excluded == ["a"] and job.nodes["a"].exclusions == 1
    assert job.round is not None and list(job.round.members) == ["b"]
    assert any(e.kind == "node_readmitted" and e.node_id == "b" for e in job.events)


def test_a_later_report_of_a_later_failure_changes_nothing():
    rz = running()
    r = rz.jobs[JOB].round.round_id
    a_then_b(rz, r, 11.0, 10.0, 11.2, 10.5)
    job = rz.jobs[JOB]
    assert job.root_cause is not None and job.root_cause.node_id == "a"
    assert job.nodes["b"].failure_times == [] and job.nodes["a"].failure_times == [11.0]


def test_a_failure_of_the_round_a_leave_ended_is_the_failure_the_jobs_end_names():
    # torchrun: b's agent leaves once its workers fail (its report came first, or was never sent); a's report on
    # that round is stale, the job waits with no round, and its join timeout must still name the crash
    config = msgspec.structs.replace(CFG, min_nodes=2, join_timeout_s=30.0)
    rz = Rendezvous()
    for i, n in enumerate(("a", "b")):
        rz.handle(JOB, JoinRequest(v=1, node_id=n, addr=f"addr-{n}", local_world_size=1, master_port=20000 + i,
                                   config=config, instance=f"{n}#1"), i * 0.01)
    r = rz.jobs[JOB].round.round_id
    rz.handle(JOB, LeaveRequest(v=1, node_id="b", reason="the torchrun agent stopped after its workers failed"), 5.0)
    assert rz.jobs[JOB].round is None
    report(rz, "a", r, 5.1, 4.9, "ValueError: bad batch")
    rz.handle(JOB, LeaveRequest(v=1, node_id="a", reason="the torchrun agent stopped after its workers failed"), 5.2)
    deadline = rz.next_deadline()
    assert deadline is not None
    rz.tick(deadline)
    job = rz.jobs[JOB]
    assert job.state == JobState.FAILED and job.restart_count == 0
    assert job.root_cause is not None and job.root_cause.node_id == "a"
    assert "last failure: rank 0" in job.reason and "node a" in job.reason, job.reason


def test_past_the_budget_the_late_earlier_failure_is_the_root_cause_the_failed_job_names():
    rz = Rendezvous()
    config = msgspec.structs.replace(CFG, max_restarts=0)
    for i, n in enumerate(("a", "b")):
        rz.handle(JOB, JoinRequest(v=1, node_id=n, addr=f"addr-{n}", local_world_size=1, master_port=20000 + i,
                                   config=config, instance=f"{n}#1"), i * 0.01)
    crash_on_a_reported_by_b_first(rz, 10.0)
    job = rz.jobs[JOB]
    assert job.state == JobState.FAILED
    assert job.root_cause is not None and job.root_cause.node_id == "a" and job.root_cause.rank == 0
    assert job.reason.endswith("; root cause: rank 0 (local 0) on addr-a: exit code 1: ValueError: bad batch"), \
        job.reason
    status = rz.view(JOB, "b", 12.0)
    assert status.root_cause is not None and status.root_cause.node_id == "a"


def test_a_failure_stamped_before_its_round_formed_moves_no_blame():
    # an agent's clock (or a hostile agent) stamps what it likes: a's crash reported first is a's count; b's late
    # report stamped before round 2 even formed must not take it (with exclude_after=1: readmit a, exclude b)
    rz = running()
    report(rz, "a", rz.jobs[JOB].round.round_id, 11.0, 10.0, "ValueError: bad batch")   # round 2 forms at 11.0
    r = rz.jobs[JOB].round.round_id
    a_then_b(rz, r, 20.5, 20.0, 21.0, 5.0)
    job = rz.jobs[JOB]
    assert job.nodes["b"].failure_times == [] and job.nodes["b"].state != NodeState.EXCLUDED
    assert job.excluded == ["a"] and job.root_cause is not None and job.root_cause.node_id == "a"


def test_a_failure_stamped_after_the_round_failed_moves_no_blame():
    # the first report stamped its crash in the future (a broken clock): a late stamp after the round failed
    # (counted_at) is no earlier failure, whatever it compares to
    rz = running()
    r = rz.jobs[JOB].round.round_id
    a_then_b(rz, r, 10.5, 1e6, 11.0, 10.8)
    job = rz.jobs[JOB]
    assert job.nodes["b"].failure_times == [] and job.nodes["a"].failure_times == [10.5]


def test_a_rounds_count_never_moves_back_to_a_node_it_left():
    # two agents stamping ever earlier failures of one round flipped the exclusion (and re-formed rounds,
    # restarting every worker) once per report: a node the count moved off never takes it again
    rz = running(exclude_after=1)
    r = rz.jobs[JOB].round.round_id
    report(rz, "a", r, 10.5, 10.4, "RuntimeError: [gloo] Connection closed by peer")
    report(rz, "b", r, 11.0, 10.3, "ValueError: bad batch")       # b's earlier failure: b takes the count
    formed = rz.jobs[JOB].round.round_id
    for i, n in enumerate(("a", "b", "a")):
        report(rz, n, r, 12.0 + i, 10.2 - i * 0.01, "ValueError: bad batch")
    job = rz.jobs[JOB]
    assert job.excluded == ["b"] and job.nodes["a"].exclusions == 0 and job.nodes["b"].exclusions == 1
    assert job.round is not None and job.round.round_id == formed and list(job.round.members) == ["a"]


def test_an_exclusion_served_before_the_late_report_does_not_double_the_next():
    # b's wrong exclusion ended before a's late report named the earlier crash: b's served cooldown cannot be
    # undone, but it no longer counts toward doubling b's next one
    rz = running(exclude_after=1)
    r = rz.jobs[JOB].round.round_id
    report(rz, "b", r, 10.5, 10.4, "RuntimeError: [gloo] Connection closed by peer")
    rz.tick(100.0)                                          # b's 60 s cooldown ended: b is back
    assert rz.jobs[JOB].excluded == []
    report(rz, "a", r, 101.0, 10.0, "ValueError: bad batch")
    job = rz.jobs[JOB]
    assert job.nodes["b"].exclusions == 0 and job.excluded == ["a"] and job.nodes["a"].exclusions == 1


def test_a_report_from_a_node_outside_the_failed_round_moves_no_blame():
    # c was a spare in round r: its "failure" of round r (a broken or hostile agent) must not readmit a, whose
    # crash failed it, nor exclude c and re-form the round
    rz = Rendezvous()
    config = msgspec.structs.replace(CFG, exclude_after=1)
    for i, n in enumerate(("a", "b", "c")):
        rz.handle(JOB, JoinRequest(v=1, node_id=n, addr=f"addr-{n}", local_world_size=1, master_port=20000 + i,
                                   config=config, instance=f"{n}#1"), i * 0.01)
    r = rz.jobs[JOB].round.round_id
    assert rz.jobs[JOB].spares == ["c"]
    report(rz, "a", r, 10.5, 10.4, "ValueError: bad batch")
    formed = rz.jobs[JOB].round.round_id
    report(rz, "c", r, 11.0, 10.0, "ValueError: never ran")
    job = rz.jobs[JOB]
    assert job.excluded == ["a"] and job.nodes["c"].exclusions == 0
    assert job.round is not None and job.round.round_id == formed and job.root_cause.node_id == "a"


def test_a_victim_stamped_earlier_by_a_clock_behind_takes_no_blame():
    # a crashes at 10.0 and reports first; b's clock runs 50 ms behind, so its broken collective (really at
    # 10.02) is stamped 9.97: b's failure reads as a victim's, a's as its own error, so the count stays on a
    rz = running(exclude_after=1)
    r = rz.jobs[JOB].round.round_id
    report(rz, "a", r, 10.1, 10.0, "ValueError: bad batch")
    report(rz, "b", r, 10.2, 9.97, "RuntimeError: [gloo] Connection closed by peer")
    job = rz.jobs[JOB]
    assert job.excluded == ["a"] and job.nodes["b"].exclusions == 0 and job.root_cause.node_id == "a"
    assert job.round is not None and list(job.round.members) == ["b"]


def test_a_node_that_crashes_for_ever_keeps_a_bounded_count_and_the_largest_exclude_after_still_excludes():
    """A review: with --exclude-after 0 (a job that never excludes, --max-restarts large) or a long window, a node's
    failure_times (and the blame's copy of it, both rewritten at every failure) grew by one time per crash for the
    job's life: 3,000 crashes, 3,000 times each. The newest MAX_FAILURE_TIMES are all any --exclude-after counts."""
    from rdzv_server.core.blame import MAX_FAILURE_TIMES
    for after in (0, 1000):
        rz = Rendezvous()
        config = msgspec.structs.replace(CFG, exclude_after=after, max_restarts=100_000, exclude_window_s=86400.0)
        for i, n in enumerate(("a", "b")):
            rz.handle(JOB, JoinRequest(v=1, node_id=n, addr=f"addr-{n}", local_world_size=1, master_port=20000 + i,
                                       config=config, instance=f"{n}#1"), i * 0.01)
        job = rz.jobs[JOB]
        for i in range(3 * MAX_FAILURE_TIMES):
            if job.nodes["a"].state == NodeState.EXCLUDED:
                break
            report(rz, "a", job.round.round_id, 10.0 + i, 9.5 + i, "ValueError: bad batch")
            assert len(job.nodes["a"].failure_times) <= MAX_FAILURE_TIMES
            assert job.blame is not None and len(job.blame.before) < MAX_FAILURE_TIMES
        assert (job.nodes["a"].state == NodeState.EXCLUDED) == (after == 1000), after
        assert job.restart_count == (3 * MAX_FAILURE_TIMES if after == 0 else after)


def test_an_exclusion_taken_back_from_a_node_whose_agent_is_gone_readmits_it_once_and_admits_no_ghost():
    """A review: b's report came first and excluded it; its agent's connection then closed (restarting); a's late
    report took the blame back. b was readmitted by that, yet stayed listed excluded with a cooldown ending now, so
    the next tick readmitted it again ("finished its exclusion cooldown") and admitted it: a round opened by b, whose
    agent was gone. As an operator's clear of such a node does, it is lost now and its next agent joins afresh."""
    rz = running(exclude_after=1)
    job = rz.jobs[JOB]
    r = job.round.round_id
    report(rz, "b", r, 11.0, 10.5, "RuntimeError: [gloo] Connection closed by peer")
    assert job.nodes["b"].state == NodeState.EXCLUDED
    rz.handle(JOB, PollRequest(v=1, node_id="b", known_round=-1, wait_s=30.0), 11.05)    # held ...
    rz.connection_dropped(JOB, "b", 11.1, heard=True)                                    # ... and closed
    report(rz, "a", r, 11.2, 10.0, "ValueError: bad batch")
    rz.tick(11.3)
    readmitted = [e.message for e in job.events if e.kind == "node_readmitted" and e.node_id == "b"]
    assert len(readmitted) == 1 and "followed another node's earlier one" in readmitted[0], readmitted
    assert "b" not in job.nodes and "b" not in job.excluded and "b" not in job.waiting
    assert not any(e.kind == "round_opened" and e.node_id == "b" for e in job.events)


def script_fails_everywhere(rz: Rendezvous, now: float, a_grouped: bool = False) -> None:
    """Both nodes' workers fail at start (an ImportError in the script): b's report comes first, a's a little
    later; `a_grouped`: a's worker had begun its process group (it may be b's victim)."""
    r = rz.jobs[JOB].round.round_id
    for node, came, grouped in (("b", now + 0.1, False), ("a", now + 0.3, a_grouped)):
        failure = WorkerFailure(local_rank=0, rank=0 if node == "a" else 1, exitcode=1, timestamp=now + 0.05,
                                before_group=not grouped)
        rz.handle(JOB, FailureReport(v=1, node_id=node, round_id=r, failures=[failure]), came)


def fails(rz: Rendezvous, node: str, at: float, rank: int = 0, exitcode: int = 1, before_group: bool = True,
          round_id: int | None = None) -> None:
    """`node` reports its worker failing at `at` (before its process group by default), 0.1 s later, on the
    running round (or `round_id`)."""
    failure = WorkerFailure(local_rank=0, rank=rank, exitcode=exitcode, timestamp=at, before_group=before_group)
    r = rz.jobs[JOB].round.round_id if round_id is None else round_id
    rz.handle(JOB, FailureReport(v=1, node_id=node, round_id=r, failures=[failure]), at + 0.1)


def judged(rz: Rendezvous, at: float) -> None:
    """The bound for the others' word on a failure at start `at` passes with none said (alone.py)."""
    rz.tick(at + 0.1 + alone.WAIT_S)


def test_a_script_failing_before_its_group_on_every_node_excludes_none():
    rz = running(exclude_after=2)
    for now in (10.0, 20.0, 30.0):
        script_fails_everywhere(rz, now)
    job = rz.jobs[JOB]
    assert job.excluded == [] and job.nodes["b"].exclusions == 0 and job.nodes["b"].failure_times == []
    assert job.round is not None and list(job.round.members) == ["a", "b"]
    assert job.restart_count == 3                              # the budget counts each failed round once
    shared = [e for e in job.events if e.kind == "worker_failed" and "more than one node" in e.message]
    assert len(shared) == 3 and all(e.node_id == "a" for e in shared), shared


def test_an_exclusion_taken_back_when_the_other_node_failed_before_its_group_too():
    rz = running(exclude_after=1)
    script_fails_everywhere(rz, 10.0)
    job = rz.jobs[JOB]
    assert job.excluded == [] and job.nodes["b"].exclusions == 0
    assert job.round is not None and list(job.round.members) == ["a", "b"]


def test_a_victim_that_had_begun_its_group_leaves_the_count_where_it_was():
    rz = running(exclude_after=2)
    for now in (10.0, 20.0):
        script_fails_everywhere(rz, now, a_grouped=True)
    job = rz.jobs[JOB]
    assert job.excluded == ["b"] and job.nodes["b"].exclusions == 1


def test_counts_with_no_late_report_exclude_none_once_another_node_failed_alike():
    # The others' workers are often stopped before their own failure: round 1 shows both nodes failing before
    # their group, then only b's reports come (a's workers stopped first), more than exclude_after of them.
    rz = running(exclude_after=2)
    script_fails_everywhere(rz, 10.0)
    for now in (20.0, 30.0, 40.0):
        fails(rz, "b", now, rank=1)
    job = rz.jobs[JOB]
    assert job.excluded == [] and job.nodes["b"].exclusions == 0
    assert job.round is not None and list(job.round.members) == ["a", "b"] and job.restart_count == 4
    spared = [e for e in job.events if e.kind == "node_not_excluded"]
    assert spared and all(e.node_id == "b" and "node a" in e.message for e in spared), spared


def test_a_node_alone_failing_before_its_group_is_still_excluded():
    # b's workers fail at start (its own disk lacks a file, say); a's are b's victims, reported or not
    rz = running(exclude_after=2)
    for now in (10.0, 20.0):
        fails(rz, "b", now, rank=1)
    job = rz.jobs[JOB]
    assert job.excluded == [] and job.alone_held is not None     # held for a's word, within the bound
    judged(rz, 20.0)
    assert job.excluded == ["b"] and job.nodes["b"].exclusions == 1


def test_the_jobs_end_says_the_script_failed_at_start_on_more_than_one_node():
    rz = running()
    rz.jobs[JOB].config = msgspec.structs.replace(CFG, max_restarts=1)
    script_fails_everywhere(rz, 10.0)     # both nodes' workers fail before their group
    script_fails_everywhere(rz, 20.0)     # the budget's end: b's report is the counted one
    job = rz.jobs[JOB]
    assert job.state is JobState.FAILED, job.reason
    assert "before their process group, on 2 nodes: b, a: the script's error, not a node's" in job.reason, job.reason
    assert job.reason.startswith("worker failures exceeded max_restarts=1") and "; root cause: " in job.reason


def test_the_jobs_end_names_no_script_error_when_one_node_failed_alone():
    rz = running()
    rz.jobs[JOB].config = msgspec.structs.replace(CFG, max_restarts=0)
    failure = WorkerFailure(local_rank=0, rank=1, exitcode=1, timestamp=10.0, before_group=True)
    rz.handle(JOB, FailureReport(v=1, node_id="b", round_id=rz.jobs[JOB].round.round_id, failures=[failure]), 10.1)
    job = rz.jobs[JOB]
    assert job.state is JobState.FAILED and "script's error" not in job.reason, job.reason


def test_a_suspect_exit_code_at_start_on_every_node_makes_no_node_a_suspect():
    # A script exiting 17 (say, sys.exit(errno) after a FileExistsError) at start on every node asks for no
    # other hardware: excluding each node "as a suspect twice" shrank the job to nothing.
    rz = running(exclude_after=3)
    r = rz.jobs[JOB].round.round_id
    for node, at in (("b", 10.0), ("a", 10.2)):
        failure = WorkerFailure(local_rank=0, rank=0, exitcode=17, timestamp=at, before_group=True)
        rz.handle(JOB, FailureReport(v=1, node_id=node, round_id=r, failures=[failure]), at + 0.1)
    for now in (20.0, 30.0, 40.0):
        fails(rz, "b", now, rank=1, exitcode=17)
    job = rz.jobs[JOB]
    # (round 1's first report came before any evidence: its suspicion is taken back once a's report says the same)
    assert job.excluded == [] and job.nodes["b"].suspect_times == [], [e.message for e in job.events]
    assert job.round is not None and list(job.round.members) == ["a", "b"]
    assert any(e.kind == "node_not_excluded" and "is no suspect" in e.message for e in job.events)


def test_the_first_reporters_suspicion_for_an_exit_at_start_is_taken_back_when_another_node_exits_so():
    # sys.exit(17) before init_process_group on every node: b's report came first in round 1, before any other
    # node's, so b was made a suspect; a's late report says the script fails everywhere. Left, b's one suspicion
    # made its next real one (a 16 after steps, within the window) an exclusion, and its page said "suspicions: 1".
    rz = running(exclude_after=3)
    job = rz.jobs[JOB]
    r = job.round.round_id
    fails(rz, "b", 10.0, rank=1, exitcode=17)
    judged(rz, 10.0)
    assert len(job.nodes["b"].suspect_times) == 1
    fails(rz, "a", 10.2, exitcode=17, round_id=r)
    assert job.nodes["b"].suspect_times == [], [e.message for e in job.events]
    back = [e.message for e in job.events if e.kind == "node_not_excluded" and e.node_id == "b"]
    assert back and "no longer a suspect" in back[-1], back
    fails(rz, "b", 50.0, rank=1, exitcode=16, before_group=False)    # a real suspicion later: the first, kept
    assert job.excluded == [] and len(job.nodes["b"].suspect_times) == 1


def test_a_suspect_exit_code_on_one_node_alone_still_makes_it_a_suspect():
    rz = running(exclude_after=3)
    job = rz.jobs[JOB]
    for now in (10.0, 20.0):
        fails(rz, "b", now, rank=1, exitcode=17)
        assert job.alone_held is not None and job.restart_count == int(now // 20)   # held for a's word: the round runs
        judged(rz, now)
    assert job.excluded == ["b"] and len(job.nodes["b"].suspect_times) == 2


def test_a_members_report_on_a_round_it_did_not_fail_in_keeps_no_bad_node_in():
    # b's GPU fails CUDA init before its process group every round, alone. a (buggy, or hostile) sends reports of
    # a worker failing before its group on rounds it cannot speak for: one long gone, one never run. Only a
    # member's report on the running round, or on the round just failed, speaks for its workers: else a's stale
    # word kept b from its exclusion for a whole window, as if the script failed everywhere.
    rz = running(exclude_after=3)
    job = rz.jobs[JOB]
    bogus = WorkerFailure(local_rank=0, rank=0, exitcode=1, timestamp=5.0, before_group=True)
    for now in (10.0, 20.0, 30.0):
        r = job.round.round_id
        for stale in (r + 50, r - 2):      # (at 30.0, r - 2 is the round b failed at 10.0: a was in it, long ago)
            rz.handle(JOB, FailureReport(v=1, node_id="a", round_id=stale, failures=[bogus]), now - 1.0)
        fails(rz, "b", now, rank=1, round_id=r)
    judged(rz, 30.0)
    assert job.excluded == ["b"] and job.nodes["b"].exclusions == 1, [e.message for e in job.events]
    assert not any(e.kind == "node_not_excluded" for e in job.events)


def test_a_node_excluded_before_any_other_nodes_start_failure_came_is_readmitted_when_one_does():
    # An ImportError on every node: a's report came first in each of the first rounds, the others' workers were
    # stopped before their own failure, so nothing yet said the script fails everywhere and a was excluded (3 real
    # agents: 2 runs of 6). The first other node's workers failing before their group say it: a comes back.
    rz = running(exclude_after=2)
    job = rz.jobs[JOB]
    for now in (10.0, 20.0):
        fails(rz, "a", now)
    judged(rz, 20.0)        # (b's workers stopped before their own failure: nothing said within the bound)
    assert job.excluded == ["a"]
    fails(rz, "b", 30.0)
    assert job.excluded == [] and job.nodes["a"].exclusions == 0, [e.message for e in job.events]
    back = [e.message for e in job.events if e.kind == "node_readmitted" and e.node_id == "a"]
    assert len(back) == 1 and "before their process group, as node b's" in back[0], back
    assert job.round is not None and sorted(job.round.members) == ["a", "b"]


def test_a_node_excluded_for_failures_after_its_group_stays_out_when_another_fails_at_start():
    rz = running(exclude_after=2)
    job = rz.jobs[JOB]
    for now in (10.0, 20.0):
        fails(rz, "a", now, before_group=False)     # it had begun its group
    fails(rz, "b", 30.0)
    assert job.excluded == ["a"] and job.nodes["a"].exclusions == 1


def test_a_suspect_excluded_before_any_other_nodes_start_failure_came_is_readmitted_when_one_does():
    # A script exiting 17 at start everywhere: a's report came first in rounds 1 and 2, before any other node's
    # failure, so a was "a suspect twice". b's workers then fail before their group too: a comes back.
    rz = running(exclude_after=3)
    job = rz.jobs[JOB]
    for now in (10.0, 20.0):
        fails(rz, "a", now, exitcode=17)
        judged(rz, now)
    assert job.excluded == ["a"], [e.message for e in job.events]
    fails(rz, "b", 30.0, exitcode=17)
    assert job.excluded == [] and job.round is not None and sorted(job.round.members) == ["a", "b"]
    assert job.nodes["a"].suspect_times == [], [e.message for e in job.events]   # both of them taken back


def test_the_jobs_end_names_every_member_whose_late_report_said_it_failed_at_start():
    # 6 nodes, all failing at start: the first report of round 1 is counted, the next takes it back (shared), and
    # the 4 after it must still count as their own (members of the round just failed), though no blame is left.
    rz, config = Rendezvous(), msgspec.structs.replace(CFG, min_nodes=6, max_nodes=6, max_restarts=1)
    nodes = [f"n{i}" for i in range(6)]
    for i, n in enumerate(nodes):
        rz.handle(JOB, JoinRequest(v=1, node_id=n, addr=f"addr-{n}", local_world_size=1, master_port=20000 + i,
                                   config=config, instance=f"{n}#1"), i * 0.01)
    job = rz.jobs[JOB]
    for now in (10.0, 20.0):
        r = job.round.round_id
        for k, n in enumerate(nodes):
            failure = WorkerFailure(local_rank=0, rank=k, exitcode=1, timestamp=now, before_group=True)
            rz.handle(JOB, FailureReport(v=1, node_id=n, round_id=r, failures=[failure]), now + 0.1 + k * 0.01)
    assert job.state is JobState.FAILED
    assert "before their process group, on 6 nodes: n0, n1, n2, n3, n4, ...: the script's" in job.reason, job.reason



def three_running(exclude_after: int) -> Rendezvous:
    rz, config = Rendezvous(), msgspec.structs.replace(CFG, min_nodes=1, max_nodes=3, exclude_after=exclude_after)
    for i, n in enumerate(("a", "b", "c")):
        rz.handle(JOB, JoinRequest(v=1, node_id=n, addr=f"addr-{n}", local_world_size=1, master_port=20000 + i,
                                   config=config, instance=f"{n}#1"), i * 0.01)
    return rz


@pytest.mark.parametrize("code", [17, 1])       # a suspect exit code; an ImportError's 1 (--exclude-after)
def test_the_first_report_of_a_script_failing_at_start_makes_no_suspect_and_excludes_none(code: int):
    # 3 node-agents, sys.exit(17) at start: a's report came first in rounds 1 and 2, and the round at once failed
    # on it: b's and c's workers were stopped before their own exit said anything. a was "a suspect twice",
    # excluded, then readmitted once b's report came: the job shrank meanwhile, an operator saw an exclusion.
    # Held, the round runs on until b's workers fail at start too and say so: no node is ever suspected.
    rz = three_running(exclude_after=2)
    job = rz.jobs[JOB]
    for now in (10.0, 20.0):
        r = job.round.round_id
        fails(rz, "a", now, exitcode=code)
        fails(rz, "b", now + 0.3, rank=1, exitcode=code, round_id=r)
    judged(rz, 30.0)
    kinds = {e.kind for e in job.events}
    assert "node_suspect" not in kinds and "node_excluded" not in kinds, [e.message for e in job.events]
    assert job.excluded == [] and job.nodes["a"].suspect_times == [] and job.nodes["a"].exclusions == 0
    assert job.restart_count == 2 and job.root_cause is not None and job.root_cause.node_id == "a"
    assert sorted(job.round.members) == ["a", "b", "c"]


@pytest.mark.parametrize("code", [17, 1])
def test_a_node_failing_at_start_alone_among_three_is_still_judged_with_no_restart_more(code: int):
    # a broken host: a's workers fail at start; b's and c's wait in their group for it (b's a victim, once stopped)
    rz = three_running(exclude_after=2)
    job = rz.jobs[JOB]
    fails(rz, "a", 10.0, exitcode=code)
    judged(rz, 10.0)                    # nobody else said a word within the bound
    assert job.restart_count == 1 and job.alone_held is None
    fails(rz, "a", 20.0, exitcode=code)
    assert job.excluded == [] and job.alone_held is not None and job.restart_count == 1
    fails(rz, "b", 20.2, rank=1, exitcode=1, before_group=False, round_id=job.round.round_id)  # a's victim
    assert job.excluded == ["a"] and job.alone_held is None, [e.message for e in job.events]
    assert job.restart_count == 2 and sorted(job.round.members) == ["b", "c"]
