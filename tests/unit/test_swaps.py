"""A slow node swapped for a spare at the job's next snapshot (rdzv_server/core/swaps.py), through the real
Rendezvous: the members are asked to hold after their next snapshot; the swap waits for a node's ranks to hold
and for the suspect's copy of that step to be on its peer, then the spare takes its place in a round formed at
once (no restart spent) and the suspect is quarantined; no snapshot within the wait swaps anyway; a spare gone
meanwhile swaps nothing. A suspect whose agent serves its own snapshots is the spare's source: the swap needs
no copy on a peer, nor peer copies at all (one failure domain)."""
from __future__ import annotations

import msgspec

from protocol.messages import LeaveRequest, NodeState, PollRequest, poll_ready
from protocol.notes import CopiesNote, ProgressNote
from rdzv_server.core.events import EventKind, RoundCause
from rdzv_server.core.rendezvous import Rendezvous
from rdzv_server.core.swaps import SWAP_WAIT_S
from tests.unit.progress_jobs import CFG, T, join

CONFIG = msgspec.structs.replace(CFG, min_nodes=3, max_nodes=3, replace_slow_nodes=True)


def poll(rz: Rendezvous, node: str, now: float, *, waited: float = -1.0, held: int = -1,
         copied: int | None = 10, holding: bool = False) -> None:
    """A member's poll with its progress and (`copied`: None where copies are off) its copies' note."""
    job = rz.jobs["swap"]
    round_id = job.round.round_id if job.round is not None else -1
    progress = ProgressNote(round_id=round_id, probes=2, steps=100, step_s=0.2, window_s=4.0, window_steps=20,
                            demand=0.5, waited=waited, held_step=held)
    copies = CopiesNote(local_step=copied, copied_step=copied) if copied is not None else None
    rz.handle("swap", PollRequest(v=1, node_id=node, credential=f"secret-{node}", known_round=round_id, wait_s=0.0,
                                  progress=progress, copies=copies, holding=holding), now)


def slow_b(rz: Rendezvous, *, copy_port: int = 0, domain: str = "", copied: int | None = 10) -> None:
    """A job of a, b, c (b the others wait on) with spare s; every node holds and copied step 10 (`copied`)."""
    for node in ("a", "b", "c", "s"):
        join(rz, "swap", node, T, CONFIG, copy_port=copy_port, domain=domain)
    at = T
    while rz.jobs["swap"].swap is None:
        at += 1
        assert at < T + 100, "b was never named slow"
        for node, waited in (("a", 0.2), ("b", 0.02), ("c", 0.2)):
            poll(rz, node, at, waited=waited, copied=copied)


def hold_asked(rz: Rendezvous, node: str) -> bool:
    return rz.view("swap", node, T + 200).hold_at_snapshot


def test_the_swap_waits_for_the_snapshot_the_members_hold_after_and_the_suspects_copy_of_it() -> None:
    rz = Rendezvous()
    slow_b(rz)
    job = rz.jobs["swap"]
    first = job.round.round_id
    assert [hold_asked(rz, n) for n in ("a", "b", "c", "s")] == [True, True, True, False]     # not the spare
    poll(rz, "a", T + 150, held=15, copied=15, holding=True)    # a's ranks wait after step 15 ...
    assert job.round.round_id == first                         # ... but b's copy of 15 is not on its peer yet
    poll(rz, "b", T + 151, copied=15, holding=True)
    assert job.round.round_id == first + 1 and job.restart_count == 0
    assert job.round.members == ["a", "s", "c"]                # the spare in b's place (group rank 1)
    assert job.nodes["b"].state == NodeState.EXCLUDED and job.swap is None
    formed = [e for e in job.events if e.kind == EventKind.ROUND_COMPLETED][-1]
    assert formed.data is not None and formed.data["cause"] == RoundCause.SWAPPED.value
    # the same 3 places: the job neither grew nor shrank (b's exclusion took it out of the round's members)
    assert "grows" not in formed.message and "step 0" not in formed.message, formed.message
    swapped = [e.message for e in job.events if e.kind == EventKind.NODE_SUSPECT]
    assert swapped[-1].startswith("node b swapped for spare s at the snapshot of step 15"), swapped
    assert not hold_asked(rz, "a")                             # the new round holds nowhere


def test_no_snapshot_within_the_wait_swaps_anyway_and_says_so() -> None:
    rz = Rendezvous()
    slow_b(rz)
    job = rz.jobs["swap"]
    first = job.round.round_id
    rz.tick(job.swap.until - 1)
    assert job.round.round_id == first
    rz.tick(job.swap.until)
    assert job.round.round_id == first + 1 and "b" not in job.round.members
    assert any(f"now: no snapshot came within {SWAP_WAIT_S:g}s" in e.message for e in job.events)


def test_a_spare_gone_before_the_snapshot_swaps_nothing_and_the_hold_ends() -> None:
    rz = Rendezvous()
    slow_b(rz)
    job = rz.jobs["swap"]
    first = job.round.round_id
    job.nodes["s"].ready = False            # the spare is no longer ready (its warm interpreter restarts, say)
    poll(rz, "a", T + 150, held=15, copied=15, holding=True)
    poll(rz, "b", T + 151, copied=15, holding=True)
    assert job.round.round_id == first and "b" in job.round.members and job.swap is None
    assert not hold_asked(rz, "a")
    assert "no spare is ready any more: not swapped" in job.events[-1].message


def test_a_members_poll_is_answered_once_its_hold_is_not_the_one_it_knows() -> None:
    rz = Rendezvous()
    slow_b(rz)
    view = rz.view("swap", "a", T + 200)
    round_id = view.round_id
    assert poll_ready(view, round_id, holding=False)           # news: hold after the next snapshot
    assert not poll_ready(view, round_id, holding=True)        # known: held until the round changes


def test_a_place_swapped_once_is_not_swapped_again_and_says_why_once() -> None:
    """A pipeline's structure can make one place wait least whoever holds it: the spare named slow there in turn
    is not swapped (the spares would be gone through one by one)."""
    rz = Rendezvous()
    slow_b(rz)
    job = rz.jobs["swap"]
    join(rz, "swap", "t", T + 140, CONFIG)                      # another spare, ready
    poll(rz, "a", T + 150, held=15, copied=15, holding=True)
    poll(rz, "b", T + 151, copied=15, holding=True)
    assert job.round.members == ["a", "s", "c"] and "t" in job.spares
    for at in range(160, 200):                                  # s, in b's place, is waited on in turn
        for node, waited in (("a", 0.2), ("s", 0.02), ("c", 0.2)):
            poll(rz, node, T + at, waited=waited)
    said = [e.message for e in job.events if "the place itself is slow" in e.message]
    assert job.progress.slow == ["s"] and job.swap is None and job.round.members == ["a", "s", "c"]
    assert len(said) == 1 and said[0].startswith("node s is slow at group rank 1"), said


def test_a_suspect_serving_its_own_snapshots_is_the_spares_source_with_no_peer_copy() -> None:
    # One failure domain: peer copies are off (no CopiesNote), but every agent takes copies on port 7000, so the
    # suspect serves its own: the ranks are asked to hold (no swap at once), and the spare fetches from b itself.
    rz = Rendezvous()
    slow_b(rz, copy_port=7000, domain="rack", copied=None)
    job = rz.jobs["swap"]
    first = job.round.round_id
    own_token = rz.view("swap", "b", T + 140).assignment.copy_token
    assert job.swap is not None and own_token and hold_asked(rz, "a")
    poll(rz, "a", T + 150, held=15, copied=None, holding=True)    # a's ranks wait after step 15 ...
    assert job.round.round_id == first          # ... but b, the source, has not written its own snapshot of 15 yet
    poll(rz, "b", T + 150.5, held=15, copied=None, holding=True)  # (a slow node writes it last): swapped now
    assert job.round.round_id == first + 1 and job.round.members == ["a", "s", "c"]
    spare = rz.view("swap", "s", T + 151).assignment
    assert (spare.copies_of, spare.copies_token) == ("b", own_token)
    assert spare.copies_at is not None and (spare.copies_at.addr, spare.copies_at.port) == ("10.0.0.1", 7000)
    assert spare.copies_also is None                           # no peer holds b's copies: one source only
    swapped = [e.message for e in job.events if e.kind == EventKind.NODE_SUSPECT]
    assert swapped[-1].startswith("node b swapped for spare s at the snapshot of step 15"), swapped


def test_with_copies_on_the_suspect_itself_is_the_source_before_its_peers_copy() -> None:
    rz = Rendezvous()
    slow_b(rz, copy_port=7000)          # each node its own failure domain: copies go to peers
    job = rz.jobs["swap"]
    poll(rz, "a", T + 150, held=15, copied=12, holding=True)      # b's copy of 15 is not on its peer: no matter,
    assert "b" in job.round.members
    poll(rz, "b", T + 150.5, copied=15)                           # once b's own ranks hold 15 (its copies' note)
    assert "b" not in job.round.members
    spare = rz.view("swap", "s", T + 151).assignment
    assert spare.copies_of == "b" and spare.copies_at is not None and spare.copies_at.port == 7000
    (gone, source, holder), = job.round.copies.values()       # b itself first, its peer copies' holder second
    assert (gone, source) == ("b", "b") and holder in ("a", "c") and spare.copies_also is not None, job.round.copies


def test_a_lost_nodes_place_is_still_fetched_from_its_peers_copy() -> None:
    rz = Rendezvous()
    for node in ("a", "b", "c"):
        join(rz, "swap", node, T, CONFIG, copy_port=7000)
    job = rz.jobs["swap"]
    first = job.round.round_id
    join(rz, "swap", "s", T + 1, CONFIG, copy_port=7000)
    for node in ("a", "b", "c"):
        poll(rz, node, T + 2, copied=10)
    rz.handle("swap", LeaveRequest(v=1, node_id="b", credential="secret-b", reason="gone"), T + 3)
    assert job.round.round_id == first + 1 and "b" not in job.nodes
    gone, holder = job.round.copies["s"]
    assert gone == "b" and holder in ("a", "c") and "s" not in job.round.copies_from


def test_a_suspect_that_keeps_pace_again_before_the_snapshot_is_not_swapped() -> None:
    """Slow for a while (a neighbour's job on its host, say), b keeps pace again before the snapshot the swap waits
    for: the swap is called off and the ranks go on; b is not excluded for a slowness it no longer has."""
    rz = Rendezvous()
    slow_b(rz)
    job = rz.jobs["swap"]
    first, at = job.round.round_id, T + 100
    while not any(e.kind == EventKind.NODE_PACE_OK for e in job.events):
        at += 1
        assert at < T + 200, "b never kept pace again"
        for node in ("a", "b", "c"):
            poll(rz, node, at, waited=0.2)
    assert job.swap is None and not hold_asked(rz, "a")
    poll(rz, "a", at + 1, held=15, copied=15, holding=True)    # a late hold of a's: nothing to swap at
    poll(rz, "b", at + 2, held=15, copied=15, holding=True)
    assert job.round.round_id == first and job.round.members == ["a", "b", "c"]
    assert job.nodes["b"].state == NodeState.MEMBER and job.spares == ["s"]
    said = [e.message for e in job.events if e.kind == EventKind.NODE_PACE_OK]
    assert said == ["node b keeps pace again: its swap for a spare is called off"], said


def test_a_slow_node_swapped_out_is_readmitted_when_its_spare_is_lost_and_the_job_waits() -> None:
    """The spare that took b's place is lost at once: the job, short of nodes, does not wait out b's cooldown (it
    trained nothing for a minute) but readmits b, slow but working, as flap damping's hold-off ends; an exclusion
    for failures is kept."""
    rz = Rendezvous()
    slow_b(rz)
    job = rz.jobs["swap"]
    poll(rz, "a", T + 150, held=15, copied=15, holding=True)
    poll(rz, "b", T + 151, copied=15, holding=True)
    assert job.nodes["b"].state == NodeState.EXCLUDED and "s" in job.round.members
    rz.handle("swap", LeaveRequest(v=1, node_id="s", credential="secret-s", reason="lost"), T + 152)
    rz.tick(T + 153)
    assert job.nodes["b"].state != NodeState.EXCLUDED, job.nodes["b"]
    said = [e.message for e in job.events if e.kind == EventKind.NODE_READMITTED]
    assert said == ["node b's exclusion as a slow node swapped out ends: the job waits for nodes"], said


def test_the_slow_node_swapped_out_and_back_in_its_place_is_swapped_again_not_called_a_slow_place() -> None:
    """b, swapped out for being slow, is readmitted in its place when its spare is lost; still slow there, it is
    slow itself, not its place (no other node was slow there): a review saw "the place itself is slow (a pipeline
    stage's share of the work?), so it is not swapped again", and the job ran at b's pace with a spare ready."""
    rz = Rendezvous()
    slow_b(rz)
    job = rz.jobs["swap"]
    poll(rz, "a", T + 150, held=15, copied=15, holding=True)
    poll(rz, "b", T + 151, copied=15, holding=True)
    rz.handle("swap", LeaveRequest(v=1, node_id="s", credential="secret-s", reason="lost"), T + 152)
    rz.tick(T + 153)
    for node in ("a", "b", "c"):
        poll(rz, node, T + 154)
    rz.tick(T + 160)
    assert job.round is not None and job.round.members == ["a", "b", "c"], job.round
    join(rz, "swap", "t", T + 161, CONFIG)                      # a new spare, ready
    at = T + 161
    while job.swap is None:
        at += 1
        assert at < T + 300, [e.message for e in job.events[-6:]]
        for node, waited in (("a", 0.2), ("b", 0.02), ("c", 0.2)):
            poll(rz, node, at, waited=waited)
    assert not any("the place itself is slow" in e.message for e in job.events)
    assert job.swap.node_id == "b" and "spare t takes its place" in job.events[-1].message, job.events[-1].message
