"""The agent's supervision policy, fed facts one at a time with plain-float time."""
from __future__ import annotations

import signal

import msgspec
import pytest

from node_agent.client.replies import Path
from node_agent.core.actions import (
    AskWitnesses,
    Exit,
    HoldAtSnapshot,
    KeepFrom,
    Leave,
    Rejoin,
    ReportFailure,
    ReportStall,
    ReportSuccess,
    Spawn,
    StopWorkers,
)
from node_agent.core.facts import (
    DeadlinePassed,
    RanksStalled,
    ServerNotReached,
    ServerRefused,
    SignalReceived,
    SpawnFailed,
    StatusReceived,
    Verdict,
    WitnessesAnswered,
    WorkersExited,
)
from node_agent.core.fencing import ASK_AGAIN_S
from node_agent.core.policy import SupervisionPolicy, Workers
from protocol.messages import (
    Assignment,
    FailureReport,
    JobState,
    JoinRequest,
    NodeState,
    NodeStatus,
    PollRequest,
    SuccessReport,
    WorkerFailure,
)
from protocol.stalls import RankSeen, RankState


def assignment(round_id: int, restart_count: int = 0) -> Assignment:
    return Assignment(round_id=round_id, group_rank=0, group_world_size=1, rank_offset=0, world_size=4,
                      local_world_size=2, master_addr="10.0.0.1", master_port=29500,
                      restart_count=restart_count, max_restarts=3)


def member(round_id: int, restart_count: int = 0) -> StatusReceived:
    return StatusReceived(PollRequest, NodeStatus(
        job_id="j", job_state=JobState.RUNNING, node_state=NodeState.MEMBER, round_id=round_id,
        restart_count=restart_count, assignment=assignment(round_id, restart_count)), sent_at=0.0)


def status(job_state: JobState = JobState.RUNNING, node_state: NodeState = NodeState.WAITING,
           **kw: object) -> StatusReceived:
    return StatusReceived(PollRequest, NodeStatus(job_id="j", job_state=job_state, node_state=node_state,
                                                  round_id=kw.pop("round_id", -1),  # type: ignore[arg-type]
                                                  restart_count=0, **kw), sent_at=0.0)  # type: ignore[arg-type]


def failure(rank: int = 1) -> WorkerFailure:
    return WorkerFailure(local_rank=rank, rank=rank, exitcode=1, message="boom", host="h1")


def failed(round_id: int, rank: int = 1) -> WorkersExited:
    return WorkersExited(round_id, (failure(rank),))


def unreachable(error: str = "refused") -> ServerNotReached:
    return ServerNotReached(PollRequest, error)


def running(round_id: int = 1, server_wait_s: float = 60) -> SupervisionPolicy:
    p = SupervisionPolicy(server_wait_s=server_wait_s)
    p.handle(member(round_id), 0.0)
    return p


def test_first_assignment_spawns_the_round() -> None:
    p = SupervisionPolicy(server_wait_s=60)
    assert p.handle(member(1), 0.0) == [Spawn(assignment(1))]
    assert p.known_round == 1 and p.workers == Workers.RUNNING


def test_same_round_again_changes_nothing() -> None:
    p = running(1)
    assert p.handle(member(1), 1.0) == []


def test_new_round_from_the_server_stops_ours_then_spawns_it() -> None:
    p = running(1)
    actions = p.handle(member(2, restart_count=1), 1.0)
    assert isinstance(actions[0], StopWorkers) and actions[1] == Spawn(assignment(2, 1))
    assert p.known_round == 2


def test_local_failure_stops_the_group_and_reports_it_for_the_running_round_once() -> None:
    p = running(3)
    actions = p.handle(failed(3), 1.0)
    assert isinstance(actions[0], StopWorkers)
    assert actions[1] == ReportFailure(3, (failure(),))
    assert p.handle(failed(3, rank=0), 1.1) == []                      # reported once
    assert p.handle(member(4, 1), 1.2) == [Spawn(assignment(4, 1))]    # nothing left to stop


def test_a_spawn_error_is_a_failure_like_an_exit() -> None:
    p = running(3)
    assert p.handle(SpawnFailed(3, failure()), 1.0) == [StopWorkers("local rank 1 failed"),
                                                        ReportFailure(3, (failure(),))]


def test_stalled_ranks_of_the_running_round_are_reported_and_the_workers_run_on() -> None:
    p = running(3)
    ranks = (RankSeen(rank=1, local_rank=1, state=RankState.QUIET, stalled_s=6.0),)
    assert p.handle(RanksStalled(3, 5.0, ranks), 1.0) == [ReportStall(3, 5.0, ranks)]
    assert p.workers == Workers.RUNNING
    assert p.handle(RanksStalled(2, 5.0, ranks), 1.1) == []           # an old round's: nothing


def test_news_about_a_round_we_no_longer_run_changes_nothing() -> None:
    p = running(1)
    p.handle(member(2, 1), 1.0)
    for old in (failed(1), WorkersExited(1, ()), SpawnFailed(1, failure())):
        assert p.handle(old, 2.0) == []
    assert p.workers == Workers.RUNNING and p.handle(failed(2), 3.0)[1] == ReportFailure(2, (failure(),))


def test_a_worker_of_an_ended_round_that_failed_before_its_group_is_still_reported() -> None:
    # Another node's failure ended the round first; ours failed by itself too, before its process group: the
    # server hears it (the script's error, counted against no node), whether a round or a wait followed.
    alone = msgspec.structs.replace(failure(), before_group=True)
    p = running(1)
    p.handle(member(2, 1), 1.0)
    assert p.handle(WorkersExited(1, (failure(), alone)), 2.0) == [ReportFailure(1, (alone,))]
    p = running(1)
    p.handle(status(node_state=NodeState.WAITING, round_id=-1), 1.0)
    assert p.handle(WorkersExited(1, (alone,)), 2.0) == [ReportFailure(1, (alone,))]
    p = running(1)
    p.handle(failed(1), 1.0)
    assert p.handle(WorkersExited(1, (alone,)), 2.0) == []          # its own round's failure: reported once


def test_all_local_workers_succeeding_is_reported_once_and_we_keep_following_the_server() -> None:
    p = running(1)
    assert p.handle(WorkersExited(1, ()), 1.0) == [ReportSuccess(1)]
    assert p.handle(WorkersExited(1, ()), 1.1) == []
    assert p.handle(member(2, 1), 2.0) == [Spawn(assignment(2, 1))]   # another node failed: run again


def test_becoming_a_spare_or_waiting_stops_our_workers() -> None:
    for state in (NodeState.SPARE, NodeState.WAITING, NodeState.EXCLUDED):
        p = running(1)
        actions = p.handle(status(node_state=state, round_id=2), 1.0)
        assert [type(a) for a in actions] == [StopWorkers]
        assert p.known_round == -1


def test_gone_means_stop_and_rejoin() -> None:
    p = running(1)
    actions = p.handle(status(node_state=NodeState.GONE, reason="lease lost"), 1.0)
    # the reason is the job's news, said as the job's (it may be about another node)
    assert isinstance(actions[0], StopWorkers)
    assert actions[1] == Rejoin("the server no longer counts this node (job j: lease lost)")


def test_job_succeeded_exits_zero() -> None:
    p = running(1)
    p.handle(WorkersExited(1, ()), 1.0)
    actions = p.handle(status(job_state=JobState.SUCCEEDED, node_state=NodeState.GONE, reason="done"), 2.0)
    assert actions == [Exit(0, "job j succeeded: done")]


def test_job_failed_exits_nonzero_with_the_root_cause() -> None:
    p = running(1)
    rc = WorkerFailure(local_rank=1, rank=3, exitcode=1, message="RuntimeError: boom", host="h2", node_id="n2",
                       traceback="Traceback...\n  line 1")
    actions = p.handle(status(job_state=JobState.FAILED, node_state=NodeState.GONE, root_cause=rc,
                              reason="worker failures exceeded max_restarts=0"), 2.0)
    assert isinstance(actions[0], StopWorkers)
    exit_ = actions[-1]
    assert isinstance(exit_, Exit) and exit_.code == 1 and exit_.root_cause == rc   # for the reply file
    assert "rank      : 3" in exit_.message and "RuntimeError: boom" in exit_.message
    assert "h2" in exit_.message and "Traceback" in exit_.message


@pytest.mark.parametrize("node_state", [NodeState.SPARE, NodeState.WAITING, NodeState.EXCLUDED])
def test_a_node_whose_workers_never_ran_does_not_exit_zero_when_the_job_succeeds(node_state: NodeState) -> None:
    p = SupervisionPolicy(server_wait_s=60)
    assert p.handle(status(node_state=node_state), 0.0) == []                 # never a member
    actions = p.handle(status(job_state=JobState.SUCCEEDED, node_state=NodeState.GONE, reason="done"), 1.0)
    assert actions == [Exit(1, "job j succeeded without this node: its workers never ran (done)")]


def test_unreachable_server_keeps_workers_until_the_window_ends() -> None:
    p = running(1)
    assert p.next_deadline() is None
    assert p.handle(unreachable(), 10.0) == []
    assert p.next_deadline() == 70.0                          # counted from the first failed try
    assert p.handle(unreachable(), 69.0) == [] and p.next_deadline() == 70.0
    actions = p.handle(unreachable("timed out"), 70.0)
    assert isinstance(actions[0], StopWorkers) and isinstance(actions[-1], Exit) and actions[-1].code == 1
    assert actions[-1].message == "rendezvous server unreachable for 60s (limit 60s): timed out"
    assert p.next_deadline() is None                          # exiting: nothing more is armed


def test_the_server_wait_fires_on_its_deadline_without_another_try() -> None:
    p = running(1)
    p.handle(unreachable("connection refused"), 10.0)
    assert p.handle(DeadlinePassed(), 69.9) == []             # early wake-up: nothing due yet
    actions = p.handle(DeadlinePassed(), 70.0)
    assert [type(a) for a in actions] == [StopWorkers, Exit] and "connection refused" in actions[-1].message


def test_reaching_the_server_again_resets_the_window() -> None:
    p = running(1)
    p.handle(unreachable(), 10.0)
    p.handle(member(1), 50.0)
    assert p.next_deadline() is None and p.handle(DeadlinePassed(), 100.0) == []
    assert p.handle(unreachable(), 100.0) == [] and p.next_deadline() == 160.0


def test_a_refusal_is_an_answer_too() -> None:
    p = running(1)
    p.handle(unreachable(), 10.0)
    p.handle(ServerRefused(FailureReport, "bad_request", "stale"), 20.0)
    assert p.next_deadline() is None


@pytest.mark.parametrize("signum, restartable, stopped", [
    (signal.SIGTERM, True, True),         # systemctl restart, a container's: it may be started again (LeaveRequest)
    (signal.SIGTERM, False, False),       # standalone, a Slurm job: no next agent takes the place
    (signal.SIGINT, True, False),         # Ctrl-C: someone ends it
])
def test_a_sigterm_of_an_agent_that_may_be_restarted_says_so_in_its_leave(signum, restartable, stopped) -> None:
    p = SupervisionPolicy(server_wait_s=60, restartable=restartable)
    p.handle(member(1), 0.0)
    name = signal.Signals(signum).name
    actions = p.handle(SignalReceived(signum), 1.0)
    leave = Leave(f"agent received {name}", stopped=stopped, stops_workers=stopped)
    # a stopped agent's leave goes first: a second signal, or its manager's SIGKILL, may cut its workers' stop short
    stop, end = StopWorkers(f"agent received {name}", signum, finish_writes=True), \
        Exit(128 + signum, f"node-agent stopped by {name}")
    assert actions == ([leave, stop, end] if stopped else [stop, leave, end])


def test_a_stopped_agent_with_no_workers_running_asks_for_no_time_to_stop_them() -> None:
    """A survivor whose round was abandoned while the job waits: nothing to stop, so the job's wait for its next
    agent need not count from the end of a stop (LeaveRequest.stop_timeout_s: 0)."""
    p = SupervisionPolicy(server_wait_s=60, restartable=True)
    assert p.handle(SignalReceived(signal.SIGTERM), 1.0)[0] == Leave("agent received SIGTERM", stopped=True)


def test_signal_stops_workers_with_that_signal_leaves_and_exits_128_plus_signal() -> None:
    p = running(1)
    actions = p.handle(SignalReceived(signal.SIGTERM), 1.0)
    assert actions == [StopWorkers("agent received SIGTERM", signal.SIGTERM, finish_writes=True),
                       Leave("agent received SIGTERM"),
                       Exit(128 + signal.SIGTERM, "node-agent stopped by SIGTERM")]
    assert p.handle(member(2), 2.0) == []                    # exiting: the server's news no longer matters
    assert p.handle(SignalReceived(signal.SIGINT), 2.0) == []


def test_server_that_forgot_the_job_makes_us_stop_and_rejoin_from_scratch() -> None:
    p = running(1)
    actions = p.handle(ServerRefused(PollRequest, "unknown_job", "no job 'j' on this server"), 5.0)
    assert isinstance(actions[0], StopWorkers) and actions[1] == Rejoin("no job 'j' on this server")
    assert p.known_round == -1
    assert p.handle(member(1), 6.0) == [Spawn(assignment(1))]   # round 1 of the new run: spawned again


def test_any_other_poll_refusal_ends_the_agent_with_the_servers_words() -> None:
    p = running(1)
    actions = p.handle(ServerRefused(PollRequest, "job_finished", "job 'j' finished"), 5.0)
    assert isinstance(actions[0], StopWorkers)
    assert actions[-1] == Exit(1, "the server refused this agent: job 'j' finished")


def test_a_refused_report_is_dropped() -> None:
    p = running(1)
    p.handle(failed(1), 1.0)
    assert p.handle(ServerRefused(FailureReport, "job_finished", "job 'j' finished"), 2.0) == []
    assert p.handle(ServerRefused(SuccessReport, "unknown_node", "gone"), 2.0) == []
    assert not p.exiting


@pytest.mark.parametrize("request_type, name", [(FailureReport, "failure"), (SuccessReport, "success"),
                                                (PollRequest, "poll")])
@pytest.mark.parametrize("code", ["bad_request", "unsupported_version", "too_large"])
def test_a_request_the_server_would_refuse_again_leaves_the_job_and_ends_the_agent(request_type, name, code) -> None:
    """A refused report was dropped, and the node waited for news that never came (issue 37: the plugin's
    report naming more workers than the server knew of hung both nodes until killed)."""
    p = running(1)
    if request_type is FailureReport:
        p.handle(failed(1), 1.0)
    actions = p.handle(ServerRefused(request_type, code, "the report names 2 failure(s)"), 2.0)
    assert actions[-2:] == [Leave(f"the server refused this node's {name} request: the report names 2 failure(s)"),
                            Exit(1, f"the rendezvous server refused this node's {name} request, and would again: "
                                    f"the report names 2 failure(s)")]
    assert all(isinstance(a, StopWorkers) for a in actions[:-2]) and p.exiting
    assert p.handle(member(2), 3.0) == []


def test_a_refused_join_ends_the_agent_and_a_drained_node_exits_zero() -> None:
    p = SupervisionPolicy(server_wait_s=60)
    assert p.handle(ServerRefused(JoinRequest, "node_drained", "node a drained: flaky NIC"), 1.0) == [
        Exit(0, "node a drained: flaky NIC")]
    p = running(1)   # a rejoin refused while workers run: they stop first
    actions = p.handle(ServerRefused(JoinRequest, "config_conflict", "max_nodes: job has 2, join asked 3"), 1.0)
    assert isinstance(actions[0], StopWorkers)
    assert actions[-1] == Exit(1, "the rendezvous server refused this node's join: max_nodes: job has 2, "
                                  "join asked 3")


def test_not_a_fact_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        SupervisionPolicy(server_wait_s=1).handle("poll", 0.0)  # type: ignore[arg-type]


# ---- credentials and tokens ----------------------------------------------------------------------

def test_a_node_taken_over_by_another_agent_stops_its_workers_and_exits_saying_so() -> None:
    p = running(1)
    actions = p.handle(ServerRefused(PollRequest, "forbidden", "the credential is not node a's"), 5.0)
    assert isinstance(actions[0], StopWorkers) and isinstance(actions[-1], Exit)
    assert actions[-1].code == 1 and "taken over" in actions[-1].message
    assert p.next_deadline() is None


def test_a_refused_token_ends_the_agent_with_the_servers_words() -> None:
    p = SupervisionPolicy(server_wait_s=60)
    actions = p.handle(ServerRefused(JoinRequest, "unauthorized", "missing or wrong token: --token-file"), 0.0)
    assert actions == [Exit(1, "the rendezvous server refused this agent: missing or wrong token: --token-file")]


def test_a_node_id_held_by_a_live_agent_is_retried_for_two_leases_then_given_up() -> None:
    # Two leases: a server restarted on its saved state (with the host that ran both) gives every node a fresh
    # lease and one more of grace; the restarted agent must outwait its predecessor's, or its node is lost.
    p = SupervisionPolicy(server_wait_s=60, lease_timeout_s=5.0)
    conflict = ServerRefused(JoinRequest, "node_conflict", "node id 'a' is held by a live agent")
    assert p.handle(conflict, 0.0) == []
    assert p.next_deadline() == 1.0                          # the retry fires by the timer
    assert p.handle(DeadlinePassed(), 1.0) == [Rejoin("this node id is still held by a live agent; trying again")]
    for t in range(1, 12):
        assert p.handle(conflict, float(t)) == []            # within 2 leases + 2 s: keep trying
        p.handle(DeadlinePassed(), t + 1.0)
    final = p.handle(conflict, 12.5)
    assert isinstance(final[-1], Exit) and final[-1].code == 1 and "held by a live agent" in final[-1].message


def test_a_conflict_that_clears_starts_the_count_again() -> None:
    p = SupervisionPolicy(server_wait_s=60, lease_timeout_s=5.0)
    conflict = ServerRefused(JoinRequest, "node_conflict", "held")
    p.handle(conflict, 0.0)
    p.handle(member(1), 2.0)                                  # the old agent was dead after all: we are in
    assert p.conflict_since is None and p.workers == Workers.RUNNING


# ---- fencing -----------------------------------------------------------------------------------------

def fenced_policy(witnesses=("10.0.0.2",)) -> SupervisionPolicy:
    from protocol.messages import Witness
    p = SupervisionPolicy(server_wait_s=60, lease_timeout_s=5.0)
    a = msgspec.structs.replace(assignment(1), group_world_size=2,
                                witnesses=tuple(Witness(addr=w, port=4000) for w in witnesses))
    p.handle(StatusReceived(PollRequest, NodeStatus(job_id="j", job_state=JobState.RUNNING,
                                                    node_state=NodeState.MEMBER, round_id=1, restart_count=0,
                                                    assignment=a), sent_at=10.0), 10.5)
    assert p.workers == Workers.RUNNING
    return p


def test_a_cut_off_node_asks_its_witnesses_once_its_lease_must_have_lapsed_and_fences_if_none_answers():
    p = fenced_policy()
    assert p.handle(unreachable(), 14.0) == []                  # first failed try at 14: keep going
    assert p.next_deadline() == 10.0 + 5.0 + 0.5 - 1.0          # sent at 10 + lease + margin, asked 1 s sooner
    probe = p.handle(DeadlinePassed(), 16.0)
    assert len(probe) == 1 and isinstance(probe[0], AskWitnesses)
    assert p.next_deadline() == 14.0 + 60                       # probing: only the give-up rule is armed
    assert p.handle(WitnessesAnswered(Verdict.SERVER_HEARD), 16.5) == []    # once more: a witness may be slow to see
    assert p.next_deadline() == 17.5
    assert isinstance(p.handle(DeadlinePassed(), 17.5)[0], AskWitnesses)
    actions = p.handle(WitnessesAnswered(Verdict.SERVER_HEARD), 17.6)
    assert isinstance(actions[0], StopWorkers) and "fenced" in actions[0].reason
    assert isinstance(actions[1], ReportFailure) and actions[1].failures[0].reason == "fenced"
    assert p.workers == Workers.FAILED


def test_silent_witnesses_are_asked_once_more_at_once_and_fence_if_still_silent():
    # A witness on a loaded host may miss the probe's time limit: one silence is not yet proof.
    p = fenced_policy()
    p.handle(unreachable(), 14.0)
    p.handle(DeadlinePassed(), 16.0)
    assert p.handle(WitnessesAnswered(Verdict.SILENT), 17.0) == [] and p.workers == Workers.RUNNING
    assert p.next_deadline() == 17.0                            # the second probe goes at once
    assert isinstance(p.handle(DeadlinePassed(), 17.0)[0], AskWitnesses)
    actions = p.handle(WitnessesAnswered(Verdict.SILENT), 18.0)
    assert isinstance(actions[0], StopWorkers) and "fenced" in actions[0].reason


def test_a_silence_before_the_lease_lapsed_is_confirmed_after_it_and_only_then_fences():
    # The first ask starts a probe's time limit before the lapse (15.5 here), so that a silence is
    # confirmed about a second after it: never concluded on before it.
    p = fenced_policy()
    p.handle(unreachable(), 14.0)
    assert isinstance(p.handle(DeadlinePassed(), 14.5)[0], AskWitnesses)
    assert p.handle(WitnessesAnswered(Verdict.SILENT, Path.NO_SERVER), 15.0) == []     # early: asked again at once
    assert isinstance(p.handle(DeadlinePassed(), 15.0)[0], AskWitnesses)
    assert p.handle(WitnessesAnswered(Verdict.SILENT, Path.NO_SERVER), 15.3) == [] and p.workers == Workers.RUNNING
    assert p.next_deadline() == 15.5                                      # twice silent, lease not lapsed
    assert isinstance(p.handle(DeadlinePassed(), 15.5)[0], AskWitnesses)
    actions = p.handle(WitnessesAnswered(Verdict.SILENT, Path.NO_SERVER), 16.5)
    assert isinstance(actions[0], StopWorkers) and "nor any endpoint answer" in actions[0].reason


def test_a_silence_ending_at_the_lapse_is_confirmed_by_one_more_ask():
    p = fenced_policy()
    p.handle(unreachable(), 14.0)
    p.handle(DeadlinePassed(), 14.5)
    assert p.handle(WitnessesAnswered(Verdict.SILENT, Path.NO_SERVER), 15.5) == [] and p.next_deadline() == 15.5
    p.handle(DeadlinePassed(), 15.5)
    stop = p.handle(WitnessesAnswered(Verdict.SILENT, Path.NO_SERVER), 16.5)
    assert isinstance(stop[0], StopWorkers)   # 1 s after lapse


def test_a_failed_try_noticed_after_the_early_ask_time_asks_at_once():
    # A held poll's dead connection is noticed by keepalive seconds after the cut: asking then, not half a
    # second later, keeps the fence within lease + 2 s of the cut (two silences of a probe's limit each).
    p = fenced_policy()
    asked = p.handle(unreachable(), 15.0)                       # past lapse - 1 s (14.5): at once
    assert len(asked) == 1 and isinstance(asked[0], AskWitnesses)
    assert p.handle(WitnessesAnswered(Verdict.SILENT, Path.NO_SERVER), 16.0) == [] and p.workers == Workers.RUNNING
    p.handle(DeadlinePassed(), 16.0)
    assert isinstance(p.handle(WitnessesAnswered(Verdict.SILENT, Path.NO_SERVER), 17.0)[0], StopWorkers)


def test_a_silence_then_witnesses_that_do_not_hear_the_server_keep_the_workers():
    p = fenced_policy()
    p.handle(unreachable(), 14.0)
    p.handle(DeadlinePassed(), 16.0)
    p.handle(WitnessesAnswered(Verdict.SILENT), 17.0)
    p.handle(DeadlinePassed(), 17.0)
    assert p.handle(WitnessesAnswered(Verdict.SERVER_AWAY), 17.3) == [] and p.workers == Workers.RUNNING


def test_witnesses_reached_but_unanswering_are_no_evidence_however_often_and_long():
    # A stranger flooding the witnesses' ports while the server is away makes them close connections unanswered:
    # this node reached them, so it is not cut off; it never fences on that, before or after the lapse.
    p = fenced_policy()
    p.handle(unreachable(), 14.0)
    p.handle(DeadlinePassed(), 14.5)
    for at in (15.0, 16.0, 17.0, 30.0):
        assert p.handle(WitnessesAnswered(Verdict.UNANSWERED), at) == [] and p.workers == Workers.RUNNING
        assert p.next_deadline() == at + ASK_AGAIN_S
        assert isinstance(p.handle(DeadlinePassed(), at + ASK_AGAIN_S)[0], AskWitnesses)
    p.handle(WitnessesAnswered(Verdict.SILENT, Path.NO_SERVER), 31.0)     # then truly cut off: confirmed once more
    p.handle(DeadlinePassed(), 31.0)
    assert isinstance(p.handle(WitnessesAnswered(Verdict.SILENT, Path.NO_SERVER), 32.0)[0], StopWorkers)


def test_witnesses_that_do_not_hear_the_server_either_keep_the_workers_and_are_asked_again():
    p = fenced_policy()
    p.handle(unreachable(), 14.0)
    p.handle(DeadlinePassed(), 16.0)
    assert p.handle(WitnessesAnswered(Verdict.SERVER_AWAY), 16.2) == [] and p.workers == Workers.RUNNING
    assert p.next_deadline() == 16.2 + ASK_AGAIN_S
    assert isinstance(p.handle(DeadlinePassed(), 17.2)[0], AskWitnesses)


def test_a_node_alone_in_its_round_is_never_fenced_and_one_with_no_witness_fences_on_the_server_check_alone():
    p = running(1)                                               # group world size 1
    p.handle(unreachable(), 14.0)
    assert p.next_deadline() == 14.0 + 60
    q = fenced_policy(witnesses=())
    q.handle(unreachable(), 14.0)
    assert q.handle(DeadlinePassed(), 16.0) == [AskWitnesses(())]   # nobody to ask: the server is still checked
    assert q.handle(WitnessesAnswered(Verdict.SILENT, Path.NO_SERVER), 16.5) == []   # once more, at once
    assert q.handle(DeadlinePassed(), 16.5) == [AskWitnesses(())]
    actions = q.handle(WitnessesAnswered(Verdict.SILENT, Path.NO_SERVER), 17.0)
    assert isinstance(actions[0], StopWorkers) and "nor any endpoint answer" in actions[0].reason


def test_a_witness_holding_a_newer_round_is_the_evidence_to_fence_at_once():
    p = fenced_policy()
    p.handle(unreachable(), 14.0)
    p.handle(DeadlinePassed(), 16.0)
    actions = p.handle(WitnessesAnswered(Verdict.ROUND_REPLACED, Path.NO_SERVER), 16.2)
    assert isinstance(actions[0], StopWorkers) and "runs a newer round" in actions[0].reason
    # a witness running no round (ours ended, the job below its minimum) is this verdict too: not said "replaced"
    assert "the server has replaced or ended its round" in actions[0].reason, actions[0].reason
    assert isinstance(actions[1], ReportFailure) and p.workers == Workers.FAILED


def test_a_witness_that_hears_the_server_in_this_nodes_round_is_no_evidence_however_often():
    # #21 item 5: b's poll answer was lost in a blip; a and c heard the server, which had replaced nothing.
    p = fenced_policy()
    p.handle(unreachable(), 14.0)
    t = 16.0
    for _ in range(5):
        assert isinstance(p.handle(DeadlinePassed(), t)[0], AskWitnesses)
        assert p.handle(WitnessesAnswered(Verdict.STILL_MEMBER, Path.NO_SERVER), t + 0.1) == []
        assert p.workers == Workers.RUNNING
        assert p.next_deadline() == t + 0.1 + ASK_AGAIN_S             # asked again a little later
        t += 1.1


@pytest.mark.parametrize("server", [Path.REACHED, Path.STANDBY])
@pytest.mark.parametrize("verdict", [Verdict.SILENT, Verdict.SERVER_HEARD])
def test_nothing_is_concluded_while_the_server_answers_a_fresh_connection_or_a_replica_takes_over(verdict, server):
    # The server (or a standby while a takeover is under way) answers a new connection: the link sends
    # again at once; a silent or older witness is no evidence then, twice or not.
    p = fenced_policy()
    p.handle(unreachable(), 14.0)
    t = 16.0
    for _ in range(3):
        p.handle(DeadlinePassed(), t)
        assert p.handle(WitnessesAnswered(verdict, server), t + 0.1) == [] and p.workers == Workers.RUNNING
        t = p.next_deadline()


def test_the_hold_at_the_next_snapshot_is_asked_once_and_let_go_with_the_round() -> None:
    p = running(1)
    held = msgspec.structs.replace(member(1).status, hold_at_snapshot=True)
    assert p.handle(StatusReceived(PollRequest, held, sent_at=0.0), 1.0) == [HoldAtSnapshot(True)]
    assert p.holding and p.handle(StatusReceived(PollRequest, held, sent_at=0.0), 2.0) == []
    actions = p.handle(member(2, restart_count=0), 3.0)        # the suspect swapped: a new round, no hold
    assert actions[-1] == HoldAtSnapshot(False) and not p.holding
    assert isinstance(actions[0], StopWorkers) and Spawn(assignment(2)) in actions


def test_the_step_to_keep_snapshots_from_is_passed_on_when_it_changes_and_let_go_when_the_job_ends() -> None:
    p = running(1)
    floor = msgspec.structs.replace(member(1).status, copies_floor=25)
    assert p.handle(StatusReceived(PollRequest, floor, sent_at=0.0), 1.0) == [KeepFrom(25)]
    assert p.handle(StatusReceived(PollRequest, floor, sent_at=0.0), 2.0) == [] and p.keep_from == (25, -1)
    later = msgspec.structs.replace(member(1).status, copies_floor=30)
    assert p.handle(StatusReceived(PollRequest, later, sent_at=0.0), 3.0) == [KeepFrom(30)]
    ended = msgspec.structs.replace(member(1).status, job_state=JobState.SUCCEEDED, assignment=None)
    assert KeepFrom(-1) in p.handle(StatusReceived(PollRequest, ended, sent_at=0.0), 4.0)


def test_both_floors_are_passed_on_when_either_changes() -> None:
    p = running(1)
    both = msgspec.structs.replace(member(1).status, copies_floor=25, held_floor=20)
    assert p.handle(StatusReceived(PollRequest, both, sent_at=0.0), 1.0) == [KeepFrom(25, 20)]
    held_only = msgspec.structs.replace(member(1).status, held_floor=30)          # copies off: the held floor alone
    assert p.handle(StatusReceived(PollRequest, held_only, sent_at=0.0), 2.0) == [KeepFrom(-1, 30)]
    assert p.handle(StatusReceived(PollRequest, held_only, sent_at=0.0), 3.0) == [] and p.keep_from == (-1, 30)


def test_ranks_asked_to_hold_after_their_snapshot_are_not_reported_stalled() -> None:
    p = running(1)
    held = msgspec.structs.replace(member(1).status, hold_at_snapshot=True)
    p.handle(StatusReceived(PollRequest, held, sent_at=0.0), 1.0)
    ranks = [RankSeen(rank=0, local_rank=0, state=RankState.WAITING, stalled_s=12.0)]
    assert p.handle(RanksStalled(1, 5.0, ranks), 2.0) == []
    p.handle(member(1), 3.0)                                   # the hold let go (no swap came)
    assert p.handle(RanksStalled(1, 5.0, ranks), 4.0) == [ReportStall(1, 5.0, ranks)]


def test_a_round_a_members_leave_ended_lets_the_writes_under_way_end_a_failures_does_not() -> None:
    """A member's agent stopped (an operator's restart) ends the round with no failure: the others' ranks may be
    mid-write, and are stopped once those writes end, as the leaving agent's are (NodeStatus.writes_end_round)."""
    left = status(node_state=NodeState.WAITING, reason="node b left", writes_end_round=1)
    assert running(1).handle(left, 1.0)[0] == StopWorkers("node is waiting: node b left", finish_writes=True)
    replaced = msgspec.structs.replace(member(2).status, writes_end_round=1)
    assert StopWorkers("round 2 replaces round 1", finish_writes=True) in \
        running(1).handle(StatusReceived(PollRequest, replaced, sent_at=0.0), 1.0)
    an_older = msgspec.structs.replace(member(3).status, writes_end_round=1)     # round 2 ended by a failure
    assert StopWorkers("round 3 replaces round 2") in \
        running(2).handle(StatusReceived(PollRequest, an_older, sent_at=0.0), 1.0)
