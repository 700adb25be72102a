"""The agent's own console lines: what each fact and action is told as."""
from __future__ import annotations

import io
import signal

from node_agent.client.replies import Path
from node_agent.core.actions import Exit, Leave, Rejoin, ReportFailure, ReportStall, Spawn, StopWorkers
from node_agent.core.facts import (
    RanksStalled,
    ServerNotReached,
    ServerRefused,
    SpawnFailed,
    StatusReceived,
    Verdict,
    WitnessesAnswered,
    WorkersExited,
)
from node_agent.core.summary import failure_summary
from node_agent.narration import STACK_LINES, Narrator
from protocol.messages import Assignment, FailureReport, JobState, NodeState, NodeStatus, PollRequest, WorkerFailure
from protocol.stalls import RankSeen, RankState

FAILURE = WorkerFailure(local_rank=1, rank=5, exitcode=-11, signal="SIGSEGV", message="boom", host="h2",
                        node_id="n2")
REPORT = [StopWorkers("x"), ReportFailure(1, (FAILURE,))]


def narrator() -> tuple[Narrator, io.StringIO]:
    out = io.StringIO()
    return Narrator("n1", out), out


def status(state: NodeState, **kw: object) -> StatusReceived:
    return StatusReceived(PollRequest, NodeStatus(job_id="j", job_state=JobState.RUNNING, node_state=state,
                                                  round_id=2, restart_count=0, **kw), 0.0)  # type: ignore[arg-type]


def test_every_line_carries_the_node_and_multi_line_messages_are_split() -> None:
    n, out = narrator()
    n.say("one\ntwo")
    n.forced_exit(signal.SIGINT)
    assert out.getvalue().splitlines() == ["[node-agent n1] one", "[node-agent n1] two",
                                           "[node-agent n1] second SIGINT: forced exit"]


def test_failures_are_told_only_when_the_policy_acted_on_them() -> None:
    n, out = narrator()
    n.fact(WorkersExited(1, (FAILURE,)), [])          # old news: the policy ignored it
    n.fact(WorkersExited(1, ()), [])                  # success: nothing to tell
    n.fact(WorkersExited(1, (FAILURE,)), REPORT)
    n.fact(SpawnFailed(1, FAILURE), REPORT)
    assert out.getvalue().splitlines() == [
        "[node-agent n1] worker rank 5 (local 1) failed with signal SIGSEGV; stopping local workers",
        "[node-agent n1] worker rank 5 (local 1) did not start: boom"]


def test_a_stall_is_told_at_its_first_look_with_each_ranks_state_and_innermost_frames() -> None:
    n, out = narrator()
    frames = "\n".join(f"f.py:{i} in f{i}" for i in range(12))
    ranks = (RankSeen(rank=4, local_rank=0, state=RankState.WAITING, stalled_s=6.04, steps=30, cpu=0.01,
                      where="f.py:0 in f0", stack=frames),
             RankSeen(rank=5, local_rank=1, state=RankState.EXITED, stalled_s=0.0, exitcode=0))
    report = [ReportStall(1, 5.0, ranks)]
    n.fact(RanksStalled(1, 5.0, ranks, first=False), report)     # a later look at the same stall: not again
    n.fact(RanksStalled(1, 5.0, ranks), [])                       # not reported: nothing to tell
    n.fact(RanksStalled(1, 5.0, ranks), report)
    lines = out.getvalue().splitlines()
    assert lines[:3] == [
        "[node-agent n1] ranks stopped stepping for 5.0s or more; what each is doing (the server decides whether "
        "the job hangs):",
        "[node-agent n1]   rank 4 (local 0): waiting, cpu 1%, 30 steps, last 6.0s ago at f.py:0 in f0",
        "[node-agent n1]       f.py:0 in f0"]
    assert len(lines) == 1 + 1 + STACK_LINES + 1 and lines[-1] == \
        "[node-agent n1]   rank 5 (local 1): exited, 0 steps, last 0.0s ago"


def test_waiting_spare_and_excluded_are_told_once_each() -> None:
    n, out = narrator()
    for _ in range(2):
        n.fact(status(NodeState.SPARE, spare_position=0), [])
    n.fact(status(NodeState.EXCLUDED, excluded_for_s=59.6, reason="3 failures"), [])
    n.fact(status(NodeState.WAITING), [])
    n.fact(status(NodeState.MEMBER), [])
    assert out.getvalue().splitlines() == [
        "[node-agent n1] job is at max nodes: waiting as spare #1",
        "[node-agent n1] this node is excluded for 60s more (job j: 3 failures)",
        "[node-agent n1] waiting for the next round: collecting nodes"]


def test_the_servers_view_of_a_stall_is_told_when_it_changes_not_as_its_seconds_grow() -> None:
    n, out = narrator()
    for line in ("rank 0 alone for 7s at t.py:4 in ev; ranks 1-3 waiting in all_reduce",
                 "rank 0 alone for 12s at t.py:4 in ev; ranks 1-3 waiting in all_reduce",
                 "rank 0 alone for 17s at t.py:9 in up; ranks 1-3 waiting in all_reduce"):
        n.fact(status(NodeState.MEMBER, stall=line), [])
    n.fact(status(NodeState.MEMBER), [])
    assert out.getvalue().splitlines() == [
        "[node-agent n1] the server sees: rank 0 alone for 7s at t.py:4 in ev; ranks 1-3 waiting in all_reduce",
        "[node-agent n1] the server sees: rank 0 alone for 17s at t.py:9 in up; ranks 1-3 waiting in all_reduce"]


def test_refused_reports_spawns_rejoins_and_exits_are_told_outages_and_leaves_are_not() -> None:
    n, out = narrator()
    n.fact(ServerRefused(FailureReport, "bad_request", "stale round"), [])
    n.fact(ServerRefused(PollRequest, "unknown_job", "no job"), [])     # told through the Rejoin it causes
    n.fact(ServerNotReached(PollRequest, "refused"), [])
    a = Assignment(round_id=3, group_rank=1, group_world_size=2, rank_offset=2, world_size=4, local_world_size=2,
                   master_addr="10.0.0.1", master_port=29500, restart_count=1, max_restarts=3)
    for action in (Spawn(a), StopWorkers("x"), Leave("bye"), Rejoin("no job 'j'"), Exit(0, "job j succeeded")):
        n.action(action)
    assert out.getvalue().splitlines() == [
        "[node-agent n1] server rejected the report: stale round",
        "[node-agent n1] round 3: group rank 1/2, ranks 2..3 of world size 4, master 10.0.0.1:29500, "
        "restart count 1/3",
        "[node-agent n1] rejoining: no job 'j'",
        "[node-agent n1] job j succeeded"]


def test_a_join_retried_for_the_same_reason_is_said_once_until_a_round_runs() -> None:
    # A second agent with a live agent's node id retries its join every second for a lease: one line, not twelve.
    n, out = narrator()
    a = Assignment(round_id=1, group_rank=0, group_world_size=1, rank_offset=0, world_size=1, local_world_size=1,
                   master_addr="10.0.0.1", master_port=29500, restart_count=0, max_restarts=0)
    held = "this node id is still held by a live agent; trying again"
    for action in (Rejoin(held), Rejoin(held), Rejoin(held), Spawn(a), Rejoin(held)):
        n.action(action)
    assert [line for line in out.getvalue().splitlines() if "rejoining" in line] == [
        f"[node-agent n1] rejoining: {held}", f"[node-agent n1] rejoining: {held}"], out.getvalue()


def test_failure_summary_names_the_root_cause() -> None:
    tb = WorkerFailure(local_rank=1, rank=5, exitcode=1, message="E: x", traceback="Traceback\n  line\n",
                       host="h2", node_id="n2", reason="exited")
    text = failure_summary(NodeStatus(job_id="j", job_state=JobState.FAILED, node_state=NodeState.GONE,
                                      round_id=2, restart_count=3, reason="budget used", root_cause=tb))
    assert text.splitlines() == [
        "job j failed: budget used", "root cause (first failure in time across all nodes):",
        "  host      : h2 (node n2)", "  rank      : 5 (local rank 1)", "  failure   : exited, exit code 1",
        "  error     : E: x", "  traceback :", "    Traceback", "      line"]


def test_a_probe_that_concludes_nothing_is_told_once_per_outage_and_says_why():
    out = io.StringIO()
    n = Narrator("node-b", out)
    n.fact(WitnessesAnswered(Verdict.STILL_MEMBER, Path.NO_SERVER), [])
    n.fact(WitnessesAnswered(Verdict.STILL_MEMBER, Path.NO_SERVER), [])
    assert out.getvalue().count("nothing was replaced") == 1
    out2 = io.StringIO()
    Narrator("node-b", out2).fact(WitnessesAnswered("server_away", Path.STANDBY), [])
    assert "takeover" in out2.getvalue()


def test_the_store_hosts_end_is_told_as_the_stores_not_a_workers() -> None:
    """A review: the round's c10d store host killed (as the kernel's OOM killer would) was told as "worker rank 0
    (local 0) failed with signal SIGKILL": no worker had died. It is reported as local rank 0's (the protocol's
    fields), but told as the store's."""
    from node_agent.workers.failures import store_failure
    from node_agent.workers.process import WorkerExit
    n, out = narrator()
    gone = store_failure(WorkerExit(local_rank=-1, rank=-1, pid=4242, exitcode=-9, signal_name="SIGKILL",
                                    error_file=None), rank=4, host="h",
                         node_id="n1")
    n.fact(WorkersExited(1, (gone,)), REPORT)
    line = out.getvalue().splitlines()[0]
    assert line.startswith("[node-agent n1] the round's c10d store, hosted by this node's agent (pid 4242), was "
                           "killed by SIGKILL") and "worker rank" not in line, line
