"""The node's own checks in the pure policy (core/node_health.py through policy.py), plain-float time."""
from __future__ import annotations

import signal

from node_agent.core.actions import CheckNode, Exit, Leave, Rejoin, ReportFailure, SendNote, Spawn, StopWorkers
from node_agent.core.facts import DeadlinePassed, NodeChecked, SignalReceived, Stage, WorkersExited
from node_agent.core.node_health import RETRY_MAX_S, NodeHealth
from node_agent.core.policy import SupervisionPolicy, Workers
from protocol.bounds import MAX_REASON
from protocol.messages import JobState, NodeState, UnhealthyKind
from tests.unit.test_narration import narrator
from tests.unit.test_policy import failure, member, status


def checked(interval: float = 5.0) -> SupervisionPolicy:
    p = SupervisionPolicy(server_wait_s=60.0)
    p.health = NodeHealth(enabled=True, interval_s=interval)
    return p


def bad(stage: str, round_id: int, kind: UnhealthyKind = UnhealthyKind.GPU, **kw: object) -> NodeChecked:
    return NodeChecked(stage, round_id, "GPU check: GPU 0: NVML: GPU is lost", kind, **kw)  # type: ignore[arg-type]


def test_the_first_round_spawns_at_once_and_a_check_runs_every_interval_while_it_runs() -> None:
    p = checked()
    assert p.handle(member(1), 10.0) == [Spawn(member(1).status.assignment)]  # type: ignore[arg-type]
    assert p.next_deadline() == 15.0
    assert p.handle(DeadlinePassed(), 15.0) == [CheckNode(Stage.RUNNING, 1)]
    assert p.next_deadline() is None                          # one in flight: no other
    assert p.handle(NodeChecked(Stage.RUNNING, 1), 15.2) == []
    assert p.next_deadline() == 20.2


def test_a_restart_on_this_node_spawns_only_once_its_check_passed() -> None:
    p = checked()
    p.handle(member(1), 0.0)
    assert p.handle(member(2, 1), 1.0) == [StopWorkers("round 2 replaces round 1"), CheckNode(Stage.RESTART, 2)]
    assert p.handle(NodeChecked(Stage.RESTART, 2), 1.1) == [Spawn(member(2, 1).status.assignment)]  # type: ignore[arg-type]
    assert p.handle(member(3, 2), 2.0)[-1] == CheckNode(Stage.RESTART, 3)
    assert p.handle(NodeChecked(Stage.RESTART, 2), 2.1) == []   # an answer for a round since replaced


def test_a_failure_is_checked_before_it_is_reported_and_reported_when_healthy() -> None:
    p = checked()
    p.handle(member(1), 0.0)
    actions = p.handle(WorkersExited(1, (failure(),)), 1.0)
    assert actions == [StopWorkers("local rank 1 failed"), CheckNode(Stage.FAILURE, 1, (failure(),))]
    assert p.handle(NodeChecked(Stage.FAILURE, 1, failures=(failure(),)), 1.1) == [ReportFailure(1, (failure(),))]


def test_an_unhealthy_node_leaves_without_reporting_and_checks_again_after_a_doubling_back_off() -> None:
    p = checked()
    p.handle(member(1), 0.0)
    p.handle(WorkersExited(1, (failure(),)), 1.0)
    actions = p.handle(bad(Stage.FAILURE, 1, failures=(failure(),)), 1.1)
    assert actions == [Leave("unhealthy: GPU check: GPU 0: NVML: GPU is lost", UnhealthyKind.GPU)]
    assert p.workers == Workers.NONE and p.running_round == -1 and p.next_deadline() == 6.1
    assert p.handle(status(node_state=NodeState.GONE), 2.0) == []   # a late answer from before: no rejoin
    assert p.handle(DeadlinePassed(), 6.1) == [CheckNode(Stage.JOIN, -1)]
    assert p.handle(bad(Stage.JOIN, -1), 6.2) == []                # still broken: no join, no second leave
    assert p.next_deadline() == 16.2                               # 5 s, then 10 s
    assert p.handle(DeadlinePassed(), 16.2) == [CheckNode(Stage.JOIN, -1)]
    assert p.handle(NodeChecked(Stage.JOIN, -1), 16.3) == [Rejoin("the node's checks passed")]


def test_a_first_join_whose_checks_pass_says_nothing_of_rejoining() -> None:
    """A review: an agent started with --health-check printed "rejoining: the node's checks passed" as it first
    joined. That is news only after a check kept the node out (the test above)."""
    p = checked()
    actions = p.handle(NodeChecked(Stage.JOIN, -1), 0.1)
    assert actions == [Rejoin("")]
    n, out = narrator()
    n.fact(NodeChecked(Stage.JOIN, -1), actions)
    for action in actions:
        n.action(action)
    assert out.getvalue() == ""


def test_the_back_off_is_capped() -> None:
    p = checked()
    p.health.give_up_s = 1e9
    p.handle(bad(Stage.JOIN, -1), 0.0)
    delays = []
    for _ in range(12):
        when = p.next_deadline()
        assert when is not None and p.handle(DeadlinePassed(), when) == [CheckNode(Stage.JOIN, -1)]
        p.handle(bad(Stage.JOIN, -1), when)
        delays.append(p.next_deadline() - when)  # type: ignore[operator]
    assert delays[:6] == [10.0, 20.0, 40.0, 80.0, 160.0, RETRY_MAX_S] and delays[-1] == RETRY_MAX_S


def test_a_check_finding_a_fault_while_workers_run_stops_them_and_leaves() -> None:
    p = checked()
    p.handle(member(1), 0.0)
    p.handle(DeadlinePassed(), 5.0)
    actions = p.handle(bad(Stage.RUNNING, 1), 5.1)
    assert [type(a) for a in actions] == [StopWorkers, Leave] and actions[1].unhealthy is UnhealthyKind.GPU  # type: ignore[union-attr]


def test_the_job_s_end_still_ends_a_node_that_is_out() -> None:
    p = checked()
    p.handle(member(1), 0.0)
    p.handle(bad(Stage.RUNNING, 1), 1.0)
    actions = p.handle(status(job_state=JobState.FAILED, reason="no healthy set"), 2.0)
    assert isinstance(actions[-1], Exit) and actions[-1].code == 1


def test_without_checks_a_failure_is_reported_at_once_but_a_stuck_worker_still_takes_the_node_out() -> None:
    p = SupervisionPolicy(server_wait_s=60.0)
    p.handle(member(1), 0.0)
    assert p.handle(WorkersExited(1, (failure(),)), 1.0) == [StopWorkers("local rank 1 failed"),
                                                            ReportFailure(1, (failure(),))]
    stuck = NodeChecked(Stage.STOP, 1, "worker process 42 still alive 10s after SIGKILL", UnhealthyKind.STUCK_WORKER)
    assert p.handle(stuck, 2.0) == [Leave("unhealthy: worker process 42 still alive 10s after SIGKILL",
                                          UnhealthyKind.STUCK_WORKER)]
    assert p.handle(DeadlinePassed(), 7.0) == [CheckNode(Stage.JOIN, -1)]   # the shell checks the pid is gone


def test_a_node_out_for_longer_than_the_job_s_join_timeout_gives_up_with_its_last_finding() -> None:
    p = checked()
    p.health.give_up_s = 60.0
    p.handle(bad(Stage.JOIN, -1), 0.0)
    now = 0.0
    while True:
        when = p.next_deadline()
        assert when is not None
        actions = p.handle(DeadlinePassed(), when)
        if actions != [CheckNode(Stage.JOIN, -1)]:
            break
        now = when
        p.handle(bad(Stage.JOIN, -1), now)
    assert when >= 60.0 and actions == [Exit(1, f"this node stayed unhealthy for {when:.0f}s (the job's join "
                                                "timeout 60s): GPU check: GPU 0: NVML: GPU is lost")]


def test_a_long_finding_is_cut_to_what_a_leave_may_carry() -> None:
    p = checked()
    p.handle(member(1), 0.0)
    many = " | ".join(f"GPU {i} (0000:{i:02x}:00.0): 3 volatile uncorrectable ECC errors; row remapping failed"
                      for i in range(64))
    leave = p.handle(NodeChecked(Stage.RUNNING, 1, many, UnhealthyKind.GPU), 1.0)[-1]
    assert isinstance(leave, Leave) and len(leave.reason) == MAX_REASON and leave.reason.startswith("unhealthy: GPU 0")


def test_a_node_unhealthy_before_its_first_join_tells_the_server_once() -> None:
    p = checked()
    told = Leave("unhealthy: GPU check: GPU 0: NVML: GPU is lost", UnhealthyKind.GPU)
    assert p.handle(bad(Stage.JOIN, -1), 0.0) == [told]
    assert p.handle(DeadlinePassed(), 5.0) == [CheckNode(Stage.JOIN, -1)]
    assert p.handle(bad(Stage.JOIN, -1), 5.1) == []


def test_a_suspect_checks_once_more_when_asked_and_says_it_passed_on_its_polls() -> None:
    """The server holds a suspect node out until its checks pass again (NodeStatus.checks_due): one check while
    it asks, a note at once when it passed, `readmit_passed` on the polls until the server stops asking."""
    p = checked()
    asked = status(node_state=NodeState.WAITING, checks_due=True)
    assert p.handle(asked, 1.0) == [CheckNode(Stage.READMIT, -1)]
    assert p.handle(asked, 1.5) == []                               # asked again: the check is under way
    assert p.handle(NodeChecked(Stage.READMIT, -1), 2.0) == [SendNote()]
    assert p.health.readmit_passed
    assert p.handle(status(node_state=NodeState.WAITING), 3.0) == [] and not p.health.readmit_passed
    failed = checked()
    failed.handle(asked, 1.0)
    assert failed.handle(bad(Stage.READMIT, -1), 2.0) == [Leave("unhealthy: GPU check: GPU 0: NVML: GPU is lost",
                                                                UnhealthyKind.GPU)]


def test_a_stopped_agent_whose_restart_waits_for_its_check_has_no_workers_to_stop():
    """A new round replaced the old one and its restart waits for the node's check: nothing is spawned, so the
    leave asks for no time to stop workers (the job's wait for its next agent would count from their stop)."""
    p = checked()
    p.restartable = True
    p.handle(member(1), 0.0)
    assert p.handle(member(2, 1), 1.0)[-1] == CheckNode(Stage.RESTART, 2)
    leave = p.handle(SignalReceived(signal.SIGTERM), 1.5)[0]
    assert leave == Leave("agent received SIGTERM", stopped=True, stops_workers=False)


def test_a_periodic_check_answered_bad_after_its_round_was_replaced_leaves_the_checks_armed() -> None:
    """A review: a periodic check was in flight when the next round came; its answer (a fault, since cleared: the
    restart's own check passed) was about the replaced round and rightly changed nothing, but the policy still
    counted that check in flight, so no periodic check ran again for the rest of the agent's life."""
    p = checked()
    p.handle(member(1), 0.0)
    assert p.handle(DeadlinePassed(), 5.0) == [CheckNode(Stage.RUNNING, 1)]
    assert p.handle(member(2, 1), 5.5)[-1] == CheckNode(Stage.RESTART, 2)
    assert p.handle(bad(Stage.RUNNING, 1), 5.6) == []                 # about round 1: its own check comes
    assert p.handle(NodeChecked(Stage.RESTART, 2), 5.7) == [Spawn(member(2, 1).status.assignment)]  # type: ignore[arg-type]
    assert p.next_deadline() == 10.7
    assert p.handle(DeadlinePassed(), 10.7) == [CheckNode(Stage.RUNNING, 2)]
