"""The agent's supervision policy, fed facts one at a time with plain-float time."""
from __future__ import annotations

import signal

from node_agent.hangwatch import HangWatch
from node_agent.policy import (Exit, Leave, Rejoin, ReportFailure, ReportSuccess, Spawn, StopWorkers,
                               SupervisionPolicy, Workers)
from protocol.messages import Assignment, JobState, NodeState, NodeStatus, WorkerFailure


def assignment(round_id: int, restart_count: int = 0) -> Assignment:
    return Assignment(round_id=round_id, group_rank=0, group_world_size=2, rank_offset=0, world_size=4,
                      local_world_size=2, master_addr="10.0.0.1", master_port=29500,
                      restart_count=restart_count, max_restarts=3)


def member(round_id: int, restart_count: int = 0) -> NodeStatus:
    return NodeStatus(job_id="j", job_state=JobState.RUNNING, node_state=NodeState.MEMBER, round_id=round_id,
                      restart_count=restart_count, assignment=assignment(round_id, restart_count))


def status(job_state=JobState.RUNNING, node_state=NodeState.WAITING, **kw) -> NodeStatus:
    return NodeStatus(job_id="j", job_state=job_state, node_state=node_state, round_id=kw.pop("round_id", -1),
                      restart_count=kw.pop("restart_count", 0), **kw)


def failure(rank: int = 1) -> WorkerFailure:
    return WorkerFailure(local_rank=rank, rank=rank, exitcode=1, message="boom", host="h1")


def running(round_id: int = 1) -> SupervisionPolicy:
    p = SupervisionPolicy(server_wait_s=60)
    p.on_status(member(round_id), 0.0)
    return p


def test_first_assignment_spawns_the_round():
    p = SupervisionPolicy(server_wait_s=60)
    actions = p.on_status(member(1), 0.0)
    assert actions == [Spawn(assignment(1))]
    assert p.known_round == 1 and p.workers == Workers.RUNNING


def test_same_round_again_changes_nothing():
    p = running(1)
    assert p.on_status(member(1), 1.0) == []


def test_new_round_from_the_server_stops_ours_then_spawns_it():
    p = running(1)
    actions = p.on_status(member(2, restart_count=1), 1.0)
    assert isinstance(actions[0], StopWorkers) and actions[1] == Spawn(assignment(2, 1))
    assert p.known_round == 2


def test_local_failure_stops_the_group_and_reports_it_for_the_running_round_once():
    p = running(3)
    actions = p.on_workers_failed([failure()], 1.0)
    assert isinstance(actions[0], StopWorkers)
    assert actions[1] == ReportFailure(3, (failure(),))
    assert p.on_workers_failed([failure()], 1.1) == []       # reported once
    assert p.on_status(member(4, 1), 1.2) == [Spawn(assignment(4, 1))]  # nothing left to stop


def test_all_local_workers_succeeding_is_reported_once_and_we_keep_following_the_server():
    p = running(1)
    assert p.on_workers_succeeded(1.0) == [ReportSuccess(1)]
    assert p.on_workers_succeeded(1.1) == []
    assert p.on_status(member(2, 1), 2.0) == [Spawn(assignment(2, 1))]  # another node failed: run again


def test_becoming_a_spare_or_waiting_stops_our_workers():
    for state in (NodeState.SPARE, NodeState.WAITING, NodeState.EXCLUDED):
        p = running(1)
        actions = p.on_status(status(node_state=state, round_id=2), 1.0)
        assert [type(a) for a in actions] == [StopWorkers]
        assert p.known_round == -1


def test_gone_means_stop_and_rejoin():
    p = running(1)
    actions = p.on_status(status(node_state=NodeState.GONE, reason="lease lost"), 1.0)
    assert isinstance(actions[0], StopWorkers) and isinstance(actions[1], Rejoin)


def test_job_succeeded_exits_zero():
    p = running(1)
    p.on_workers_succeeded(1.0)
    actions = p.on_status(status(job_state=JobState.SUCCEEDED, node_state=NodeState.GONE, reason="done"), 2.0)
    assert actions == [Exit(0, "job j succeeded: done")]


def test_job_failed_exits_nonzero_with_the_root_cause():
    p = running(1)
    rc = WorkerFailure(local_rank=1, rank=3, exitcode=1, message="RuntimeError: boom", host="h2", node_id="n2",
                       traceback="Traceback...\n  line 1")
    actions = p.on_status(status(job_state=JobState.FAILED, node_state=NodeState.GONE, root_cause=rc,
                                 reason="worker failures exceeded max_restarts=0"), 2.0)
    assert isinstance(actions[0], StopWorkers)
    exit_ = actions[-1]
    assert isinstance(exit_, Exit) and exit_.code == 1
    assert "rank 3" in exit_.message.replace("rank      : 3", "rank 3") and "RuntimeError: boom" in exit_.message
    assert "h2" in exit_.message and "Traceback" in exit_.message


def test_unreachable_server_keeps_workers_until_the_window_ends():
    p = running(1)
    assert p.on_server_unreachable("refused", 10.0) == []
    assert p.on_server_unreachable("refused", 69.0) == []
    actions = p.on_server_unreachable("refused", 70.0)
    assert isinstance(actions[0], StopWorkers) and isinstance(actions[-1], Exit) and actions[-1].code == 1
    assert "unreachable" in actions[-1].message


def test_reaching_the_server_again_resets_the_window():
    p = running(1)
    p.on_server_unreachable("refused", 10.0)
    p.on_status(member(1), 50.0)
    assert p.on_server_unreachable("refused", 100.0) == []


def test_signal_stops_workers_with_that_signal_leaves_and_exits_128_plus_signal():
    p = running(1)
    actions = p.on_signal(signal.SIGTERM, 1.0)
    assert actions[0] == StopWorkers("agent received SIGTERM", signal.SIGTERM)
    assert isinstance(actions[1], Leave) and actions[2].code == 128 + signal.SIGTERM
    assert p.on_status(member(2), 2.0) == []            # exiting: the server's news no longer matters


def test_hang_watch_ignores_ranks_that_never_beat_and_reports_the_silent_one():
    w = HangWatch(5.0)
    assert w.next_deadline() is None and w.overdue(100.0) == []
    w.beat(0, 10.0)
    w.beat(1, 12.0)
    assert w.next_deadline() == 15.0
    assert w.overdue(14.9) == []
    w.beat(0, 14.0)
    assert w.overdue(17.0) == [1]
    assert w.overdue(20.0) == [1, 0]


def test_server_that_forgot_the_job_makes_us_stop_and_rejoin_from_scratch():
    p = running(1)
    actions = p.on_rejected("unknown_job", "no job 'j' on this server", 5.0)
    assert isinstance(actions[0], StopWorkers) and isinstance(actions[1], Rejoin)
    assert p.known_round == -1
    assert p.on_status(member(1), 6.0) == [Spawn(assignment(1))]   # round 1 of the new run: spawned again


def test_any_other_refusal_ends_the_agent_with_the_servers_words():
    p = running(1)
    actions = p.on_rejected("bad_request", "node_id: must be ...", 5.0)
    assert isinstance(actions[0], StopWorkers) and actions[-1] == Exit(1, "the server refused this agent: "
                                                                          "node_id: must be ...")


def test_hang_watch_forgets_a_rank_that_exited():
    w = HangWatch(1.0)
    w.beat(0, 0.0)
    w.beat(1, 0.0)
    w.forget(0)
    assert w.overdue(5.0) == [1]
