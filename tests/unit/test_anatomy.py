"""A restart's anatomy (node_agent/core/anatomy.py): every instant from the node's last step before the restart to
its last rank's first step after it lands in exactly one phase, nested phases go to the inner one, and a node
reports only once every rank has stepped. The server keeps the slowest node's (core/goodput.py)."""
from __future__ import annotations

import pytest

from node_agent.core.anatomy import RankStart, RestartStart, of_node, of_rank
from protocol.notes import ProgressNote
from protocol.restarts import PHASES, RestartAnatomy
from rdzv_server.core import goodput

NODE = RestartStart(last_step_at=100.0, stopped_at=100.3, spawned_at=100.5)


def worker(rank: int = 0, first: float = 104.0, **spans: tuple[float, float]) -> RankStart:
    return RankStart(rank, started_at=100.6, first_step_at=first, spans=spans)


def test_the_phases_partition_the_restart_in_order() -> None:
    got = of_rank(NODE, worker(cuda=(101.0, 101.2), group=(101.5, 102.0), restore=(102.5, 103.4)))
    assert got is not None
    assert {p: round(getattr(got, p), 3) for p in PHASES} == {
        "stop": 0.3, "rendezvous": 0.2, "start": 0.1, "setup": 1.2, "cuda": 0.2, "group": 0.5, "restore": 0.9,
        "first_step": 0.6}
    assert got.total == pytest.approx(4.0)
    assert got.line() == ("4.00 s: stop 0.30 · rendezvous 0.20 · start 0.10 · set-up 1.20 · CUDA 0.20 · "
                          "process group 0.50 · restore 0.90 · first step 0.60 (rank 0)")


def test_a_phase_inside_another_counts_as_the_inner_one_and_absent_ones_as_nothing() -> None:
    got = of_rank(NODE, worker(group=(101.0, 102.0), cuda=(101.2, 101.7), restore=(0.0, 0.0)))
    assert got is not None
    assert (round(got.group, 3), round(got.cuda, 3), got.restore) == (0.5, 0.5, 0.0)
    assert round(got.setup, 3) == 0.4 and round(got.first_step, 3) == 2.0
    assert got.total == pytest.approx(4.0)


def test_a_restore_that_found_nothing_is_set_up_time() -> None:
    got = of_rank(NODE, worker(restore=(102.0, 0.0)))
    assert got is not None and got.restore == 0.0 and round(got.setup + got.first_step, 3) == 3.4


@pytest.mark.parametrize("node", [RestartStart(0.0, 100.3, 100.5), RestartStart(100.0, 99.0, 100.5)])
def test_times_that_do_not_follow_each_other_give_no_anatomy(node) -> None:
    assert of_rank(node, worker()) is None


def test_the_node_reports_its_last_rank_to_step_once_all_have() -> None:
    assert of_node(NODE, [worker(0, 103.0), worker(1, 0.0)]) is None
    got = of_node(NODE, [worker(0, 103.0), worker(5, 104.5)])
    assert got is not None and got.rank == 5 and got.total == pytest.approx(4.5)


def cost_of(p: goodput.JobProgress) -> goodput.RestartCost:
    return p.costs[-1]


def test_the_restart_keeps_the_slowest_nodes_anatomy() -> None:
    p = goodput.JobProgress()
    goodput.round_formed(p, 1, "")
    goodput.note(p, "a", ProgressNote(round_id=1, steps=3, first_step_at=10.0, last_step_at=12.0), 1, 12.0)
    goodput.round_ended(p, "failure")
    goodput.round_formed(p, 2, "failure")
    slow = RestartAnatomy(rank=3, stop=0.2, restore=1.0, first_step=0.3)
    fast = RestartAnatomy(rank=0, stop=0.2, restore=0.4, first_step=0.3)
    for node, anatomy in (("b", slow), ("a", fast)):
        goodput.note(p, node, ProgressNote(round_id=2, steps=1, first_step_at=14.0, last_step_at=14.0,
                                           anatomy=anatomy), 2, 14.0)
    assert (cost_of(p).anatomy, cost_of(p).anatomy_node) == (slow, "b")
    goodput.note(p, "b", ProgressNote(round_id=1, steps=9, anatomy=fast), 2, 15.0)    # a stale round's: dropped
    assert cost_of(p).anatomy == slow
