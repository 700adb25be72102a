"""A node told another node's copy token (it took that node's place and fetched its copies) cannot act for that node
afterwards: the node, a member again, gets a token of a new epoch (rdzv_server/core/rounds.copy_epochs). A node
back at its own place, whose token nobody else was told, keeps its own (test_copies_rounds.py: "back at its place")."""
from __future__ import annotations

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
