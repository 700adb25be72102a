"""An exclusion outlives its node's record (rdzv_server/core/gone_nodes.py): a node excluded for its failures whose
agent leaves or is lost, and is started again, stays out until its cooldown ends or an operator clears it."""
from __future__ import annotations

import msgspec

from protocol.messages import NodeState
from rdzv_server.core import gone_nodes
from rdzv_server.core.records import KeptOut
from rdzv_server.core.rendezvous import Rendezvous
from rdzv_server.web import views
from tests.unit.test_rendezvous import JOB, cfg, fail, join, leave


def excluded_b() -> tuple[Rendezvous, object]:
    """Three nodes; b's worker failed at 1.0 and b is excluded (exclude_after 1, a 60 s cooldown), its agent alive."""
    rz = Rendezvous()
    c = cfg(min_nodes=2, max_nodes=3, last_call_s=0.0, exclude_after=1, exclude_cooldown_s=60.0, max_restarts=5)
    for n in ("a", "b", "c"):
        join(rz, n, 0.0, c)
    job = rz.jobs[JOB]
    fail(rz, "b", job.round.round_id, 1.0)
    assert job.excluded == ["b"] and job.round.members == ["a", "c"]
    return rz, c


def excluded_and_left(left: bool = True) -> tuple[Rendezvous, object]:
    rz, c = excluded_b()
    job = rz.jobs[JOB]
    if left:
        leave(rz, "b", 2.0)                      # its agent stopped (to be started again by hand or by systemd)
    else:
        rz.connection_dropped(JOB, "b", 2.0, heard=True)     # killed
        rz.tick(10.0)
    assert "b" not in job.nodes
    return rz, c


def test_a_node_excluded_then_left_comes_back_excluded_for_the_rest_of_its_cooldown():
    """A review: its next agent joined straight in as a member (and an operator's clear answered 404)."""
    for left in (True, False):
        rz, c = excluded_and_left(left)
        job = rz.jobs[JOB]
        round_before = job.round.round_id
        join(rz, "b", 20.0, c, instance="b#2")
        assert job.nodes["b"].state == NodeState.EXCLUDED and job.nodes["b"].excluded_until == 61.0
        assert job.round.round_id == round_before and job.round.members == ["a", "c"]
        rz.tick(61.0)                             # its cooldown ends as it would have
        assert job.nodes["b"].state != NodeState.EXCLUDED


def test_after_its_cooldown_the_node_joins_as_any():
    rz, c = excluded_and_left()
    job = rz.jobs[JOB]
    join(rz, "b", 62.0, c, instance="b#2")
    assert job.nodes["b"].state != NodeState.EXCLUDED and "b" not in job.kept_out


def test_an_operator_clears_the_exclusion_of_a_node_whose_agent_went():
    rz, c = excluded_and_left()
    job = rz.jobs[JOB]
    rz.clear_exclusion(JOB, "b", 3.0)
    assert "b" not in job.kept_out and "cleared by operator" in job.events[-1].message
    join(rz, "b", 4.0, c, instance="b#2")
    assert job.nodes["b"].state != NodeState.EXCLUDED


def test_what_is_kept_is_bounded_and_ended_ones_go_first():
    rz, _ = excluded_and_left()
    b = rz.jobs[JOB]
    job = msgspec.structs.replace(b, kept_out={})
    for i in range(gone_nodes.MAX_KEPT_OUT):
        job.kept_out[f"old{i}"] = KeptOut(until=1.0, exclusions=1)
    node = msgspec.structs.replace(next(iter(b.nodes.values())), node_id="x", excluded_until=100.0, held_off=False)
    gone_nodes.note_gone(job, node, 50.0, was_member=False)
    assert list(job.kept_out) == ["x"]            # the ended ones made room
    for i in range(2 * gone_nodes.MAX_KEPT_OUT):
        gone_nodes.note_gone(job, msgspec.structs.replace(node, node_id=f"n{i}"), 50.0, was_member=False)
    assert len(job.kept_out) == gone_nodes.MAX_KEPT_OUT


def test_its_join_says_it_is_the_rest_of_its_exclusion_not_a_restart():
    """A review: a job of 3:3 waited out the cooldown, said as "kept out for 56s (its agent restarted)"."""
    rz, c = excluded_and_left()
    job = rz.jobs[JOB]
    join(rz, "b", 20.0, c, instance="b#2")
    said = [e.message for e in job.events if e.node_id == "b"][-1]
    assert "excluded for 41s" in said and "rest of its exclusion" in said and "restarted" not in said, said


def test_the_operators_views_show_a_node_kept_out_with_no_agent():
    rz, c = excluded_and_left()
    lists = views.node_lists(rz.jobs[JOB], 3.0, 0, 100)
    assert lists["counts"].excluded == 1
    [shown] = lists["excluded"]
    assert (shown.node_id, shown.state, shown.excluded_for_s, shown.exclusions) == ("b", "gone", 58.0, 1)
    assert views.node_lists(rz.jobs[JOB], 62.0, 0, 100)["counts"].excluded == 0      # its cooldown over


def test_lifting_a_drain_lifts_the_exclusion_the_node_had():
    rz, c = excluded_and_left()
    job = rz.jobs[JOB]
    rz.drain_node(JOB, "b", "bad disk", 3.0)
    rz.clear_exclusion(JOB, "b", 4.0)                     # "it may join again": so it does, not excluded
    join(rz, "b", 5.0, c, instance="b#2")
    assert job.nodes["b"].state != NodeState.EXCLUDED


def test_a_restarted_agent_whose_record_lives_on_is_told_the_rest_of_its_exclusion_not_a_restarts_hold():
    """A review restarted the agent of a node excluded (a suspect swapped for a spare) before its old record went:
    the job said "node b is kept out for 58.6231s (its agent restarted)", as if flap damping held it for the
    restart, where the exclusion it had ran on."""
    rz, c = excluded_b()
    job = rz.jobs[JOB]
    assert "b" in job.nodes
    join(rz, "b", 20.3333, c, instance="b#2")        # its old record not yet gone
    said = [e.message for e in job.events if e.node_id == "b"][-1]
    assert job.nodes["b"].state == NodeState.EXCLUDED and job.nodes["b"].excluded_until == 61.0
    assert "excluded for 40.7s" in said and "rest of its exclusion" in said and "restarted)" not in said, said
