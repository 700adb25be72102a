"""A node told another node's copy token (it took that node's place and fetched its copies) cannot act for that node
afterwards: the node, a member again, gets a token of a new epoch (rdzv_server/core/rounds.copy_epochs). A node
back at its own place, whose token nobody else was told, keeps its own (test_copies_rounds.py: "back at its place")."""
from __future__ import annotations

from protocol.messages import JobConfig, PollRequest
from protocol.notes import CopiesNote
from protocol.tokens import copy_verifier
from rdzv_server.core.rendezvous import Rendezvous
from tests.unit.test_copies_rounds import CFG, JOB, join, poll, started


def only(rz: Rendezvous, alive: tuple[str, ...], since: float) -> float:
    """Only `alive` poll for 6 s from `since`: the others' leases run out and the next round forms."""
    for t in range(1, 7):
        for n in alive:
            poll(rz, n, since + t)
    rz.tick(rz.next_deadline())
    return since + 7


def test_a_spare_that_took_a_place_cannot_push_as_that_node_once_it_is_back():
    """A review: s took b's place and was told b's token (to fetch b's copies); b came back and was a member again
    with the same token, so s, still a member, could push junk as b's copy and the holder would take it."""
    rz = started({"a": "1", "b": "2", "c": "3"}, CFG)
    join(rz, "s", 0.5, CFG, domain="4")                        # a spare
    t = only(rz, ("a", "c", "s"), 0.5)                        # b lost: s takes its place
    s = rz.view(JOB, "s", t).assignment
    assert s is not None and s.copies_of == "b"
    told = s.copies_token
    join(rz, "b", t, CFG, domain="2", credential="secret-b")   # b's agent back: a spare now
    t = only(rz, ("a", "c", "b"), t)                           # s lost: b takes its place
    r = rz.jobs[JOB].round
    assert r is not None and "b" in r.members
    b = rz.view(JOB, "b", t).assignment
    assert b is not None and b.copy_token and b.copy_token != told
    holders = [rz.view(JOB, m, t).assignment for m in r.members if m != "b"]
    verifiers = [x.verifier for h in holders if h is not None for x in h.copy_sources if x.node_id == "b"]
    assert verifiers and copy_verifier(told) not in verifiers and copy_verifier(b.copy_token) in verifiers


def test_a_fetch_told_again_once_its_node_is_a_member_anew_keeps_the_token_its_copies_came_with():
    """A review: s took b's place and its fetch of b's copies (held by c) had not ended when a was lost and b, back,
    took a's place with a token of a new epoch. s, told its fetch again, was told b's new token: it could act for b,
    a member, and c (b's holder no more) refused it, its copies of b having come with b's old token."""
    fixed = JobConfig(min_nodes=3, max_nodes=3, lease_timeout_s=5.0, last_call_s=0.0)
    rz = started({"a": "1", "b": "2", "c": "3"}, fixed)
    join(rz, "s", 0.5, fixed, domain="4")
    t = only(rz, ("a", "c", "s"), 0.5)                        # b lost: s takes its place
    s = rz.view(JOB, "s", t).assignment
    assert s is not None and s.copies_of == "b"
    told = s.copies_token
    join(rz, "b", t, fixed, domain="2", credential="secret-b")   # b's agent back: a spare
    for i in range(1, 7):                                      # a lost while s's fetch has not ended
        for n in ("b", "c"):
            poll(rz, n, t + i)
        rz.handle(JOB, PollRequest(v=1, node_id="s", credential="secret-s", copies=CopiesNote(local_step=-1)), t + i)
    rz.tick(rz.next_deadline())
    r = rz.jobs[JOB].round
    assert r is not None and sorted(r.members) == ["b", "c", "s"]
    s, b = rz.view(JOB, "s", t + 7).assignment, rz.view(JOB, "b", t + 7).assignment
    assert s is not None and b is not None and s.copies_of == "b" and b.copy_token != told
    assert s.copies_token == told                              # the token b's copies came with, not b's new one


def test_a_fetch_told_a_third_time_still_carries_the_token_its_copies_came_with():
    """As above, and then another round (a worker failure at c) while s's fetch has still not ended: told its fetch
    a third time, s must be told b's epoch its copies came with (0) once more, not the epoch b pushed with in the
    round before (c, holding b's copies of epoch 0, would refuse it, and s would know a token b acted with)."""
    from protocol.messages import FailureReport, WorkerFailure
    fixed = JobConfig(min_nodes=3, max_nodes=3, lease_timeout_s=5.0, last_call_s=0.0, max_restarts=3)
    rz = started({"a": "1", "b": "2", "c": "3"}, fixed)
    join(rz, "s", 0.5, fixed, domain="4")
    t = only(rz, ("a", "c", "s"), 0.5)
    s = rz.view(JOB, "s", t).assignment
    assert s is not None and s.copies_of == "b"
    told = s.copies_token
    join(rz, "b", t, fixed, domain="2", credential="secret-b")
    pending = PollRequest(v=1, node_id="s", credential="secret-s", copies=CopiesNote(local_step=-1))
    for i in range(1, 7):
        for n in ("b", "c"):
            poll(rz, n, t + i)
        rz.handle(JOB, pending, t + i)
    rz.tick(rz.next_deadline())
    r = rz.jobs[JOB].round
    assert r is not None and sorted(r.members) == ["b", "c", "s"]
    t += 7
    b_before = rz.view(JOB, "b", t).assignment
    assert b_before is not None
    rz.handle(JOB, pending, t)
    failure = WorkerFailure(local_rank=0, rank=0, exitcode=1)
    rz.handle(JOB, FailureReport(v=1, node_id="c", credential="secret-c", round_id=r.round_id, failures=[failure]),
              t + 0.1)
    for n in ("b", "c"):
        poll(rz, n, t + 0.2)
    rz.handle(JOB, pending, t + 0.2)
    r2 = rz.jobs[JOB].round
    assert r2 is not None and r2.round_id > r.round_id and sorted(r2.members) == ["b", "c", "s"]
    s = rz.view(JOB, "s", t + 1).assignment
    assert s is not None and s.copies_of == "b"
    assert s.copies_token == told and s.copies_token != b_before.copy_token


def test_a_node_lost_before_its_own_copy_of_a_fetched_place_landed_leaves_that_fetch_to_the_next():
    """A review: s took b's place and fetched b's copies (its poll told the step), then was lost before its own copy
    landed. t, taking the place, was told s's copies (none anywhere): every rank went back to step 0. Until a copy
    of its own lands the fetch is unfinished: t is told b's copies, with the token they came with."""
    from protocol.messages import PollRequest
    from protocol.notes import CopiesNote
    rz = started({"a": "1", "b": "2", "c": "3"}, CFG)
    join(rz, "s", 0.5, CFG, domain="4")
    join(rz, "t", 0.5, CFG, domain="5")
    t = only(rz, ("a", "c", "s", "t"), 0.5)                   # b lost: s takes its place
    s = rz.view(JOB, "s", t).assignment
    assert s is not None and s.copies_of == "b"
    fetched = CopiesNote(local_step=20, copied_step=-1)      # its ranks hold b's step, no copy of its own yet
    rz.handle(JOB, PollRequest(v=1, node_id="s", credential="secret-s", copies=fetched), t)
    t = only(rz, ("a", "c", "t"), t)                          # s lost: t takes its place
    got = rz.view(JOB, "t", t).assignment
    assert got is not None and got.copies_of == "b" and got.copies_token == s.copies_token, got
