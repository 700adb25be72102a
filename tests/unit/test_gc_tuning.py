"""The server's collector tuning: each tick collects the young generation and freezes its survivors
(never garbage); frozen cycles are reclaimed on refresh."""
from __future__ import annotations

import gc
import weakref

from rdzv_server.gc_tuning import EARLY_REFRESH_S, Freezer


class Node:
    def __init__(self) -> None:
        self.me = self                 # a cycle: only the cyclic collector frees it


def test_a_tick_collects_young_garbage_and_freezes_what_survived():
    enabled = gc.isenabled()
    gc.disable()                                       # only this test's own collections run meanwhile
    try:
        freezer = Freezer(refresh_s=600.0, clock=lambda: 0.0)
        kept, dropped = Node(), Node()
        dropped_probe = weakref.ref(dropped)
        del dropped                                    # cyclic garbage before the tick: collected, not frozen
        freezer.tick()                                 # no collection of CPython's own since: it runs one
        assert dropped_probe() is None
        assert gc.is_tracked(kept) and _frozen(kept)
    finally:
        gc.unfreeze()
        if enabled:
            gc.enable()


def test_a_cycle_that_dies_frozen_is_reclaimed_on_refresh():
    clock = [0.0]
    enabled = gc.isenabled()
    gc.disable()
    try:
        freezer = Freezer(refresh_s=600.0, clock=lambda: clock[0])
        kept = Node()
        probe = weakref.ref(kept)
        freezer.tick()
        del kept                                       # garbage now, but frozen: a full walk does not see it
        gc.collect()
        assert probe() is not None
        clock[0] = 600.0                               # the refresh: unfrozen, collected, frozen again
        freezer.tick()
        assert probe() is None
    finally:
        gc.unfreeze()
        if enabled:
            gc.enable()


def test_frozen_cycles_are_reclaimed_early_once_the_frozen_objects_doubled():
    """A flood of connections leaves their cycles frozen: the walk comes once the frozen objects doubled (and
    EARLY_REFRESH_S since the last), not an hour later."""
    clock, frozen = [0.0], [300_000]
    enabled = gc.isenabled()
    gc.disable()
    try:
        freezer = Freezer(refresh_s=3600.0, clock=lambda: clock[0], frozen=lambda: frozen[0])
        kept = Node()
        probe = weakref.ref(kept)
        freezer.tick()
        del kept
        clock[0], frozen[0] = EARLY_REFRESH_S, 599_999        # not yet doubled: still frozen
        freezer.tick()
        assert probe() is not None
        frozen[0] = 600_000
        freezer.tick()
        assert probe() is None
        clock[0] = 2 * EARLY_REFRESH_S                       # the baseline is what the walk left frozen
        kept = Node()
        probe = weakref.ref(kept)
        freezer.tick()
        del kept
        clock[0] = 3 * EARLY_REFRESH_S
        freezer.tick()
        assert probe() is not None
    finally:
        gc.unfreeze()
        if enabled:
            gc.enable()


def _frozen(obj: object) -> bool:
    """Whether `obj` is in the permanent generation (no young or older generation lists it)."""
    return not any(o is obj for generation in range(3) for o in gc.get_objects(generation))


def test_the_per_node_messages_a_round_change_builds_are_not_tracked_by_the_collector():
    from protocol.messages import Assignment, JobState, NodeState, NodeStatus, Witness, WorkerFailure
    witness = Witness(addr="10.0.0.2", port=29600)
    assignment = Assignment(round_id=1, group_rank=0, group_world_size=2, rank_offset=0, world_size=2,
                            local_world_size=1, master_addr="10.0.0.1", master_port=29500, restart_count=0,
                            max_restarts=3, witnesses=(witness,))
    status = NodeStatus(job_id="j", job_state=JobState.RUNNING, node_state=NodeState.MEMBER, round_id=1,
                        restart_count=0, assignment=assignment,
                        root_cause=WorkerFailure(local_rank=0, rank=0, exitcode=1))
    assert not any(gc.is_tracked(m) for m in (witness, assignment, status, status.root_cause))
