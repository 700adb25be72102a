"""An agent stopped by a signal (`systemctl restart`, a container stopped and started again) keeps its place as a
killed one does (rdzv_server/core/awaiting.py): its leave says `stopped`, and an elastic job that would lose state
only it holds waits for its next agent rather than shrinking (before: the node behind it closed up over its ranks,
and every rank went back to step 0). The reply tells the agent how long, so it keeps its memory for the next one.
Pure core, time as plain floats."""
from __future__ import annotations

import msgpack
import msgspec
import pytest

from protocol.messages import JobConfig, JobState, LeaveRequest, NodeState, NodeStatus, UnhealthyKind
from rdzv_server.core.awaiting import window_s
from rdzv_server.core.rendezvous import Rendezvous
from tests.unit.test_awaiting import ELASTIC, WINDOW, b_then_c_back, heard, last_event, snapshots
from tests.unit.test_rendezvous import JOB, fail, job, join, members, running, view


def stop(rz: Rendezvous, node: str, now: float, *, stopped: bool = True, held: bool = True,
         unhealthy: UnhealthyKind | None = None, stop_timeout_s: float = 0.0) -> NodeStatus:
    """`node`'s agent got SIGTERM: it leaves, then stops its workers (within `stop_timeout_s`). `held`: its polls
    told a snapshot of its own."""
    if held:
        snapshots(rz, node, now - 0.5)
    return rz.handle(JOB, LeaveRequest(v=1, node_id=node, reason="agent received SIGTERM", stopped=stopped,
                                       unhealthy=unhealthy, stop_timeout_s=stop_timeout_s), now)


def test_a_stopped_member_keeps_its_place_until_its_next_agent_joins():
    rz = running(["a", "b", "c"], ELASTIC)
    reply = stop(rz, "b", 10.0)
    assert reply.node_state == NodeState.GONE and reply.place_kept_s == pytest.approx(WINDOW)
    assert job(rz).round is None and job(rz).state == JobState.WAITING and job(rz).awaited == ["b"]
    said = last_event(rz, "round_waiting")
    assert f"waiting up to {WINDOW:g}s for node b to come back" in said and "left: agent received SIGTERM" in said
    assert view(rz, "b", 12.0).place_kept_s == pytest.approx(WINDOW - 2.0)
    heard(rz, "ac", 12.0)
    join(rz, "b", 13.0, ELASTIC, instance="b#2")          # systemd started it again
    assert members(rz) == ["a", "b", "c"] and job(rz).restart_count == 0 and job(rz).awaited == []
    assert view(rz, "b", 13.0).place_kept_s == 0.0


def test_a_stopped_member_not_back_within_the_window_is_gone_on_without():
    rz = running(["a", "b", "c"], ELASTIC)
    stop(rz, "b", 10.0)
    heard(rz, "ac", 14.0, 10.0 + WINDOW - 0.01)
    rz.tick(10.0 + WINDOW - 0.01)
    assert job(rz).round is None
    rz.tick(10.0 + WINDOW)
    assert members(rz) == ["a", "c"] and job(rz).restart_count == 0
    assert f"node b not back within {WINDOW:g}s" in last_event(rz, "round_completed")


def test_the_wait_for_a_stopped_member_counts_from_when_its_workers_may_be_stopped():
    """A script that saves a checkpoint on SIGTERM takes its time: the agent's next instance comes once its
    workers are stopped, which may take them its --stop-timeout (the leave says how long). Before, the window
    counted from the leave, and a stop longer than it lost the node its place (an elastic job shrank)."""
    rz = running(["a", "b", "c"], ELASTIC)
    reply = stop(rz, "b", 10.0, stop_timeout_s=20.0)
    assert reply.place_kept_s == pytest.approx(20.0 + WINDOW) and job(rz).awaited == ["b"]
    assert f"waiting up to {20.0 + WINDOW:g}s for node b" in last_event(rz, "round_waiting")
    heard(rz, "ac", 15.0, 20.0, 25.0)
    rz.tick(10.0 + WINDOW)
    assert job(rz).round is None
    join(rz, "b", 29.0, ELASTIC, instance="b#2")            # its workers took 18 s to save and stop
    assert members(rz) == ["a", "b", "c"] and job(rz).restart_count == 0


def test_a_stopped_member_whose_workers_stop_and_which_never_comes_back_is_gone_on_without_then():
    rz = running(["a", "b", "c"], ELASTIC)
    stop(rz, "b", 10.0, stop_timeout_s=20.0)
    heard(rz, "ac", 15.0, 20.0, 25.0, 30.0, 35.0, 10.0 + 20.0 + WINDOW)
    rz.tick(10.0 + 20.0 + WINDOW - 0.01)
    assert job(rz).round is None
    rz.tick(10.0 + 20.0 + WINDOW)
    assert members(rz) == ["a", "c"]


def test_one_stopped_while_the_job_waits_for_another_is_awaited_until_its_workers_may_be_stopped_too():
    cfg = JobConfig(min_nodes=2, max_nodes=4, max_restarts=3, lease_timeout_s=5.0, last_call_s=3.0)
    rz = running(["a", "b", "c", "d"], cfg)
    stop(rz, "b", 10.0)
    heard(rz, "acd", 10.5)
    assert stop(rz, "c", 11.0, stop_timeout_s=30.0).place_kept_s == pytest.approx(30.0 + window_s(cfg))
    assert job(rz).awaited == ["b", "c"] and job(rz).last_call_deadline == pytest.approx(41.0 + window_s(cfg))
    # the job says so (it said "waiting up to 8s for node b")
    assert job(rz).reason.endswith(f"waiting up to {30.0 + window_s(cfg):g}s for nodes b, c to come back (an agent "
                                   f"restarting keeps its place)"), job(rz).reason
    b_then_c_back(rz, cfg)


def back_preparing_and_stopped(rz: Rendezvous, cfg: JobConfig, node: str, now: float, instance: str) -> None:
    """`node`'s next agent joins, tells a snapshot of its own while it prepares, and is stopped (its workers within
    30 s)."""
    join(rz, node, now, cfg, instance=instance, ready=False)
    snapshots(rz, node, now + 0.2, ready=False)
    rz.handle(JOB, LeaveRequest(v=1, node_id=node, reason="agent received SIGTERM", stopped=True,
                                stop_timeout_s=30.0), now + 0.5)


def test_a_member_stopped_again_as_it_prepares_moves_the_wait_no_further():
    """Its stop's time counts once: a next agent stopped again and again while it prepares (a probe in a loop;
    flap damping off) would otherwise hold the job for good. The wait ends at its bound, two windows from the
    end of the first stop, and the round forms without it."""
    cfg = JobConfig(min_nodes=2, max_nodes=3, max_restarts=3, lease_timeout_s=5.0, last_call_s=3.0,
                    exclude_lost_after=0)
    rz = running(["a", "b", "c"], cfg)
    stop(rz, "b", 10.0, stop_timeout_s=30.0)
    bound = 10.0 + 30.0 + 2 * window_s(cfg)
    t = 12.0
    while job(rz).round is None and t < 200.0:
        back_preparing_and_stopped(rz, cfg, "b", t, f"b#{t:g}")
        t += 2.0
        heard(rz, "ac", t)
        rz.tick(t)
    assert job(rz).round is not None and t <= bound + 2.0 and members(rz) == ["a", "c"], t


def test_a_member_given_up_then_stopped_again_moves_the_wait_no_further():
    """Its next agent stopped before its first note (nothing of its own told: given up), the one after it noting a
    snapshot and stopped again, in a loop, while c is still awaited: b's stop counted once, the wait ends at its
    bound (flap damping off)."""
    cfg = JobConfig(min_nodes=2, max_nodes=4, max_restarts=3, lease_timeout_s=5.0, last_call_s=3.0,
                    exclude_lost_after=0)
    rz = running(["a", "b", "c", "d"], cfg)
    stop(rz, "b", 10.0, stop_timeout_s=30.0)
    stop(rz, "c", 10.5, stop_timeout_s=30.0)              # c never comes back
    bound = 10.5 + 30.0 + 2 * window_s(cfg)
    t, k = 12.0, 0
    while job(rz).round is None and t < 400.0:
        k += 1
        join(rz, "b", t, cfg, instance=f"b#{k}a", ready=False)
        rz.handle(JOB, LeaveRequest(v=1, node_id="b", reason="agent received SIGTERM", stopped=True), t + 0.2)
        back_preparing_and_stopped(rz, cfg, "b", t + 0.5, f"b#{k}b")
        t += 2.0
        heard(rz, "ad", t)
        rz.tick(t)
    assert job(rz).round is not None and t <= bound + 2.0, t


def test_the_job_names_only_the_nodes_it_still_waits_for():
    """c, awaited with b, comes back and leaves for good (SIGINT): the job's reason names b alone; and when the
    wait ends, only the nodes not back are said to be not back."""
    cfg = JobConfig(min_nodes=2, max_nodes=4, max_restarts=3, lease_timeout_s=5.0, last_call_s=3.0)
    rz = running(["a", "b", "c", "d"], cfg)
    stop(rz, "b", 10.0)
    stop(rz, "c", 10.5)
    join(rz, "c", 11.0, cfg, instance="c#2", ready=False)
    rz.handle(JOB, LeaveRequest(v=1, node_id="c", reason="agent received SIGINT"), 11.5)
    assert job(rz).awaited == ["b"] and "for node b to come back" in job(rz).reason, job(rz).reason
    rz2 = running(["a", "b", "c", "d"], cfg)
    stop(rz2, "b", 10.0)
    stop(rz2, "c", 10.5)
    join(rz2, "b", 12.0, cfg, instance="b#2", ready=True)
    heard(rz2, "ad", 14.0, 18.0)
    rz2.tick(10.5 + window_s(cfg))
    said = last_event(rz2, "round_completed")
    assert f"node c not back within {window_s(cfg):g}s of its agent's end" in said, said


def test_a_leave_cannot_hold_the_job_past_ten_minutes():
    with pytest.raises(msgspec.ValidationError, match="stop_timeout_s"):
        msgspec.msgpack.decode(msgpack.packb({"v": 1, "node_id": "b", "stopped": True, "stop_timeout_s": 601.0}),
                               type=LeaveRequest)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(msgspec.ValidationError):
            msgspec.msgpack.decode(msgpack.packb({"v": 1, "node_id": "b", "stop_timeout_s": bad}), type=LeaveRequest)


@pytest.mark.parametrize("case", ["plain-leave", "unhealthy", "nothing-held", "replicas"])
def test_a_leave_the_job_loses_nothing_by_is_gone_on_without_at_once(case):
    """A leave not from a stop (the server refused the node, an older agent), one unhealthy (its host is held out
    anyway), a node with no snapshot in memory, a DDP job (its ranks replicas): the round forms at once."""
    rz = running(["a", "b", "c"], ELASTIC)
    if case == "replicas":     # (the others hold the snapshot too: a lone holder is awaited, test_lone_holder.py)
        job(rz).progress.alike_step, job(rz).progress.all_alike = 10, True
        snapshots(rz, "a", 9.0)
    reply = stop(rz, "b", 10.0, stopped=case != "plain-leave", held=case != "nothing-held",
                 unhealthy=UnhealthyKind.GPU if case == "unhealthy" else None)
    assert members(rz) == ["a", "c"] and job(rz).awaited == [] and reply.place_kept_s == 0.0


def test_one_stopped_while_the_job_waits_for_another_is_awaited_too():
    cfg = JobConfig(min_nodes=2, max_nodes=4, max_restarts=3, lease_timeout_s=5.0, last_call_s=3.0)
    rz = running(["a", "b", "c", "d"], cfg)
    stop(rz, "b", 10.0)
    heard(rz, "acd", 10.5)
    stop(rz, "c", 11.0)
    assert job(rz).awaited == ["b", "c"] and job(rz).round is None
    b_then_c_back(rz, cfg)


def test_every_agent_stopped_leaves_the_job_waiting_for_nodes_as_before():
    """srun ending a job, every node drained at once: nothing to form a round from; the join timeout runs, and each
    is told its place is kept that long. (Every agent restarted at once, an upgrade: test_awaiting.py's
    test_members_restarting_together_below_min_keep_their_places_when_enough_are_back.)"""
    rz = running(["a", "b", "c"], ELASTIC)
    kept = [stop(rz, node, 10.0 + i * 0.1).place_kept_s for i, node in enumerate("abc")]
    assert job(rz).round is None and job(rz).last_call_deadline is None
    assert job(rz).join_deadline == pytest.approx(10.0 + ELASTIC.join_timeout_s)
    assert kept[-1] == pytest.approx(ELASTIC.join_timeout_s - 0.2) and min(kept) > 0, kept


def test_a_fixed_size_job_keeps_a_stopped_members_place_while_it_waits_for_nodes():
    """Below min_nodes the job waits for nodes anyway, and a node back takes its old place: the reply tells its
    agent to keep its memory (with copies off, the only place its ranks' snapshots are)."""
    fixed = JobConfig(min_nodes=3, max_nodes=3, lease_timeout_s=5.0, last_call_s=3.0)
    rz = running(["a", "b", "c"], fixed)
    reply = stop(rz, "b", 10.0, held=False)
    assert reply.place_kept_s == pytest.approx(fixed.join_timeout_s) and job(rz).awaited == []
    join(rz, "b", 14.0, fixed, instance="b#2")
    assert members(rz) == ["a", "b", "c"] and view(rz, "b", 14.0).place_kept_s == 0.0


def test_one_that_leaves_while_others_are_awaited_is_told_its_place_is_not_kept():
    """The awaited ones' return forms the round: the node behind a plain leaver closes up over its place."""
    cfg = JobConfig(min_nodes=2, max_nodes=4, max_restarts=3, lease_timeout_s=5.0, last_call_s=3.0)
    rz = running(["a", "b", "c", "d"], cfg)
    stop(rz, "b", 10.0)
    heard(rz, "acd", 10.5)
    assert stop(rz, "c", 11.0, stopped=False).place_kept_s == 0.0 and job(rz).awaited == ["b"]


def test_an_agent_stopped_again_and_again_is_a_flapping_host():
    """A restart is a loss to flap damping, as a killed agent's is (a container restarted by a failing probe, in a
    loop): stopped a third time within exclude_window_s (a restart gets one loss more than exclude_lost_after), it
    is not awaited, and is kept out."""
    rz = running(["a", "b", "c"], ELASTIC)
    for i, t in enumerate((10.0, 20.0)):
        heard(rz, "ac", t)
        stop(rz, "b", t)
        assert job(rz).awaited == ["b"], i
        join(rz, "b", t + 2.0, ELASTIC, instance=f"b#{i + 2}")
        assert members(rz) == ["a", "b", "c"], i
    heard(rz, "ac", 30.0)
    stop(rz, "b", 30.0)
    assert members(rz) == ["a", "c"] and job(rz).awaited == []
    join(rz, "b", 32.0, ELASTIC, instance="b#4")
    assert view(rz, "b", 32.0).node_state == NodeState.EXCLUDED


def test_once_nobody_is_left_to_go_on_with_the_job_says_it_waits_for_nodes():
    rz = running(["a", "b", "c"], ELASTIC)
    stop(rz, "a", 10.0)
    assert "to come back" in job(rz).reason
    stop(rz, "b", 10.1)
    stop(rz, "c", 10.2)
    assert job(rz).reason.endswith("left: agent received SIGTERM; waiting for nodes"), job(rz).reason


def test_a_node_stopped_while_a_last_call_can_form_the_round_without_it_is_told_its_place_is_not_kept():
    """min 3 of 5: c left, d and e came, the last call runs with a, b, d, e; b is stopped: the call's end forms
    a, d, e. Its memory would be kept for nothing."""
    cfg = JobConfig(min_nodes=3, max_nodes=5, max_restarts=3, lease_timeout_s=5.0, last_call_s=3.0)
    rz = running(["a", "b", "c"], cfg)
    stop(rz, "c", 10.0, stopped=False)
    join(rz, "d", 10.5, cfg)
    join(rz, "e", 10.6, cfg)
    assert job(rz).round is None and job(rz).last_call_deadline is not None
    assert stop(rz, "b", 11.0).place_kept_s == 0.0


def test_whether_a_node_holds_a_snapshot_is_saved_with_it():
    """A server restarted on its state must still know a node held state of its own, or a node stopped or killed
    while it was away would not be awaited (every rank from step 0). Saved when it changes, not at every note."""
    rz = running(["a", "b", "c"], ELASTIC)
    rz.take_effects()
    snapshots(rz, "b", 5.0)
    assert rz.take_effects().nodes.get(JOB) == {"b"}
    snapshots(rz, "b", 6.0, step=15)
    assert not rz.take_effects().nodes.get(JOB)


def test_the_restart_under_way_while_the_job_waits_names_the_next_round():
    """rdzv-ctl and the page showed "#-1" for the restart of a job waiting for its stopped node."""
    from protocol.views import RestartCostView
    assert RestartCostView(round_id=-1, cause="node_left", cost_s=None, redone=None).round_label == "#next"
    assert RestartCostView(round_id=4, cause="failure", cost_s=1.0, redone=0).round_label == "#4"


def test_a_round_a_stopped_members_leave_ended_tells_the_others_their_writes_may_end():
    """No failure ended it: the others' ranks may be mid-write, and their agents let those writes end before they
    stop them, as the leaving agent does its own (NodeStatus.writes_end_round). A round a failure ends does not."""
    rz = running(["a", "b", "c"], ELASTIC)
    first = job(rz).round.round_id
    assert view(rz, "a", 1.0).writes_end_round == -1
    stop(rz, "b", 10.0)
    assert view(rz, "a", 10.0).writes_end_round == first and view(rz, "c", 10.0).writes_end_round == first
    heard(rz, "ac", 12.0)
    join(rz, "b", 13.0, ELASTIC, instance="b#2")
    second = job(rz).round.round_id
    fail(rz, "a", second, 14.0)
    assert job(rz).round.round_id != second and view(rz, "a", 14.0).writes_end_round == first   # not the failed one
