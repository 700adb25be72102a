"""The server's side of peer copies (issue 46): where each member's copies go, and what a node that takes a
gone node's place is told to fetch. Pure core, time as plain floats."""
from __future__ import annotations

import msgspec
import pytest

from protocol.messages import JobConfig, JobState, JoinRequest, NodeStatus, PollRequest, Witness
from protocol.notes import CopiesNote
from protocol.tokens import copy_verifier
from rdzv_server.core.rendezvous import Rendezvous
from rdzv_server.core.requests import Arrival
from rdzv_server.core.rounds import run_of
from rdzv_server.web import views

JOB = "job-c"


def join(rz: Rendezvous, node: str, now: float, config: JobConfig, *, domain: str = "", probe: int = 4000,
         credential: str = "", verifiers: bool = True) -> NodeStatus:
    req = JoinRequest(v=1, node_id=node, addr=f"10.0.0.{ord(node[0]) - 96}", local_world_size=2, master_port=20000,
                      config=config, instance=f"{node}#1", host=f"host-{node}", witness_port=probe, copy_port=probe,
                      domain=domain, copy_verifiers=verifiers)
    return rz.handle(JOB, req, now, Arrival(secret=credential or f"secret-{node}"))


def poll(rz: Rendezvous, node: str, now: float) -> NodeStatus:
    return rz.handle(JOB, PollRequest(v=1, node_id=node, credential=f"secret-{node}"), now)


def outlive(rz: Rendezvous, alive: tuple[str, ...]) -> None:
    """Only `alive` poll for 5 s: the other members' leases run out and the next round forms."""
    for t in (1.0, 2.0, 3.0, 4.0, 5.0):
        for n in alive:
            poll(rz, n, t)
    rz.tick(rz.next_deadline())


def started(nodes: dict[str, str], config: JobConfig) -> Rendezvous:
    """A job of `nodes` (node -> failure domain, in group-rank order) running its first round."""
    rz = Rendezvous()
    for i, (n, domain) in enumerate(nodes.items()):
        join(rz, n, i * 0.01, config, domain=domain)
    if rz.jobs[JOB].state == JobState.WAITING:
        deadline = rz.next_deadline()
        assert deadline is not None
        rz.tick(deadline)
    return rz


CFG = JobConfig(min_nodes=2, max_nodes=3, lease_timeout_s=5.0, last_call_s=0.0)


def targets(rz: Rendezvous, node: str, now: float = 1.0) -> list[str]:
    a = rz.view(JOB, node, now).assignment
    assert a is not None
    return [w.addr for w in a.replicas]


def test_each_members_copies_go_to_the_next_member_in_another_failure_domain():
    rz = started({"a": "rack1", "b": "rack1", "c": "rack2"}, CFG)
    assert targets(rz, "a") == ["10.0.0.3"]          # b shares a's rack: c
    assert targets(rz, "b") == ["10.0.0.3"]
    assert targets(rz, "c") == ["10.0.0.1"]          # round the ring
    a, b, c = (rz.view(JOB, n, 1.0).assignment for n in "abc")
    assert a is not None and b is not None and c is not None
    assert len(a.copy_token) == 48 and len({a.copy_token, b.copy_token, c.copy_token}) == 3    # a node's own
    assert "secret-a" not in (a.copy_token, b.copy_token)
    # c holds a's and b's copies: it knows their tokens, and only theirs (a holds c's)
    assert {(x.node_id, x.verifier) for x in c.copy_sources} == {("a", copy_verifier(a.copy_token)),
                                                                  ("b", copy_verifier(b.copy_token))}
    assert {x.token for x in c.copy_sources} == {""}       # a holder is told no other node's token
    assert [x.node_id for x in a.copy_sources] == ["c"] and b.copy_sources == ()


def test_without_a_domain_the_host_is_the_domain_and_a_node_that_takes_no_copies_holds_none():
    rz = Rendezvous()
    join(rz, "a", 0.0, CFG)
    join(rz, "b", 0.01, CFG, probe=0)                 # an agent without a listener: no copies to or from it
    join(rz, "c", 0.02, CFG)
    assert targets(rz, "a") == ["10.0.0.3"] and targets(rz, "b") == [] and targets(rz, "c") == ["10.0.0.1"]


def test_all_in_one_failure_domain_no_copies_and_replicas_zero_none_each_said_once():
    rz = started({"a": "r", "b": "r", "c": "r"}, CFG)
    assert [targets(rz, n) for n in "abc"] == [[], [], []]
    off = started({"a": "1", "b": "2", "c": "3"}, JobConfig(min_nodes=2, max_nodes=3, replicas=0))
    assert [targets(off, n) for n in "abc"] == [[], [], []]
    for job, says in ((rz, "off: every member is in one failure domain ('r'"), (off, "off (--replicas 0)")):
        assert job.jobs[JOB].copies_off.startswith(says)
        formed = [e.message for e in job.jobs[JOB].events if e.kind == "round_completed"]
        assert f"; peer copies {says}" in formed[0] and not any("peer copies" in m for m in formed[1:]), formed
        assert views.job_detail(job.jobs[JOB], 1.0).copies_off.startswith(says)
    outlive(rz, ("a", "b"))                      # c lost: the next round says nothing new of the copies
    formed = [e.message for e in rz.jobs[JOB].events if e.kind == "round_completed"]
    assert len(formed) == 3 and "peer copies" not in formed[2], formed
    assert started({"a": "1", "b": "2", "c": "3"}, CFG).jobs[JOB].copies_off == ""     # copies made: nothing said


def test_a_torchrun_job_is_told_its_launcher_keeps_no_snapshots_not_to_drop_no_memory_dir():
    rz = Rendezvous()
    for i, n in enumerate("ab"):     # as torchrun's plugin joins: no copy port, launcher "torchrun"
        rz.handle(JOB, JoinRequest(v=1, node_id=n, addr=f"10.0.0.{i + 1}", local_world_size=2, master_port=1,
                                 config=CFG, instance=n, launcher="torchrun", domain=n), i * 0.01,
                  Arrival(secret=f"secret-{n}"))
    rz.tick(rz.next_deadline() or 1.0)
    off = rz.jobs[JOB].copies_off
    assert off.startswith("off: torchrun starts this job's workers") and "--no-memory-dir" not in off, off
    formed = [e.message for e in rz.jobs[JOB].events if e.kind == "round_completed"]
    assert formed and f"; peer copies {off}" in formed[0], formed


def test_a_job_made_without_a_secret_has_no_key_and_so_no_copies():
    rz = Rendezvous()
    for i, n in enumerate("abc"):
        rz.handle(JOB, JoinRequest(v=1, node_id=n, addr=f"10.0.0.{i + 1}", local_world_size=1, master_port=1,
                                 config=CFG, instance=n, witness_port=4000, copy_port=4000,
                                 copy_verifiers=True, domain=n), i * 0.01)
    assert [targets(rz, n) for n in "abc"] == [[], [], []]


def test_the_node_taking_a_lost_nodes_place_is_told_who_holds_its_copies():
    rz = started({"a": "1", "b": "2", "c": "3"}, CFG)
    join(rz, "s", 0.5, CFG, domain="4")
    outlive(rz, ("a", "c", "s"))         # b is silent: lost; s takes its place
    r = rz.jobs[JOB].round
    assert r is not None and r.members == ["a", "s", "c"]
    s = rz.view(JOB, "s", 6.0).assignment
    assert s is not None and s.copies_of == "b" and s.copies_at == Witness(addr="10.0.0.3", port=4000)   # b's went to c
    first_b = [x.verifier for x in rz.view(JOB, "c", 6.0).assignment.copy_sources if x.node_id == "s"]
    assert s.copies_token and s.copies_token != s.copy_token               # b's token, to fetch its copies
    assert first_b == [copy_verifier(s.copy_token)]
    others = [rz.view(JOB, n, 6.0).assignment for n in ("a", "c")]
    assert all(o is not None and o.copies_of == "" and o.copies_at is None for o in others)
    assert targets(rz, "a", 6.0) == ["10.0.0.19"]     # a's copies now go to s (a's old holder, b, is gone)


def test_with_two_replicas_the_node_taking_a_place_is_told_both_holders():
    """A review (--replicas 2): the one holder named had no copy of the lost node while the other had step 30: the
    node taking its place never asked it, and every rank went to step 0. Told both, it asks the second where the
    first has none."""
    two = JobConfig(min_nodes=3, max_nodes=4, lease_timeout_s=5.0, last_call_s=0.0, replicas=2)
    rz = started({"a": "1", "b": "2", "c": "3", "d": "4"}, two)
    join(rz, "s", 0.5, two, domain="5")
    outlive(rz, ("a", "c", "d", "s"))    # b is silent: lost; s takes its place
    s = rz.view(JOB, "s", 6.0).assignment
    assert s is not None and s.copies_of == "b" and s.copies_at is not None and s.copies_also is not None
    assert {s.copies_at.addr, s.copies_also.addr} == {"10.0.0.3", "10.0.0.4"}, s     # b's went to c and d


@pytest.mark.parametrize("alike", [False, True])
def test_a_lost_node_whose_holder_was_lost_with_it_leaves_nothing_to_fetch(alike: bool):
    """Where the job's ranks are replicas (DDP: their digests agreed) each rank resumes from a replica's snapshot,
    not from disk: the round says so (a review read "every rank resumes from disk" and then saw step 20 in memory)."""
    rz = started({"a": "1", "b": "2", "c": "3"}, CFG)
    rz.jobs[JOB].progress.all_alike = alike
    join(rz, "s", 0.5, CFG, domain="4")
    join(rz, "t", 0.5, CFG, domain="5")
    for n in ("b", "c"):
        poll(rz, n, 0.5)
    outlive(rz, ("a", "s", "t"))         # b and its holder c lost together
    r = rz.jobs[JOB].round
    assert r is not None and r.members == ["a", "s", "t"]
    s, t = (rz.view(JOB, n, 6.0).assignment for n in ("s", "t"))
    assert s is not None and s.copies_of == "" and s.copies_at is None          # b's copies were on c
    assert t is not None and t.copies_of == "c" and t.copies_at == Witness(addr="10.0.0.1", port=4000)  # c's on a
    formed = [e for e in rz.jobs[JOB].events if e.kind == "round_completed"][-1]
    assert "no copy of b's snapshots is left" in formed.message and "no copy of c" not in formed.message
    assert ("every rank resumes from disk" in formed.message) != alike
    assert ("each rank resumes from the newest snapshot a replica holds" in formed.message) == alike
    assert "(it had no peer to hold them, its peer was lost too, or" in formed.message    # a lone node had none
    assert ("else from disk or step 0" in formed.message) == alike       # no replica may hold one (a review: step 0)


def test_a_fixed_size_job_waiting_for_a_node_keeps_where_the_lost_nodes_copies_are():
    fixed = JobConfig(min_nodes=3, max_nodes=3, lease_timeout_s=5.0, last_call_s=0.0)
    rz = started({"a": "1", "b": "2", "c": "3"}, fixed)
    outlive(rz, ("a", "c"))              # b is silent: lost; 2 < min 3: the job waits
    assert rz.jobs[JOB].round is None and rz.jobs[JOB].place_copies["b"].holders == ["c"]
    join(rz, "s", 7.0, fixed, domain="4")             # the node that comes takes b's place, and its copies
    r = rz.jobs[JOB].round
    assert r is not None and r.members == ["a", "s", "c"], r
    s = rz.view(JOB, "s", 7.0).assignment
    assert s is not None and s.copies_of == "b" and s.copies_at == Witness(addr="10.0.0.3", port=4000)
    assert rz.jobs[JOB].place_copies == {}


def test_a_node_back_at_its_own_place_with_a_new_agent_is_told_where_its_own_copies_are():
    """Its agent restarted under its own id (an OOM kill, systemd's Restart=): the new record at the old place is a
    new incarnation, told to fetch its own copies (its memory may be gone), and of the job's run."""
    fixed = JobConfig(min_nodes=3, max_nodes=3, lease_timeout_s=5.0, last_call_s=0.0)
    rz = started({"a": "1", "b": "2", "c": "3"}, fixed)
    before = rz.view(JOB, "b", 1.0).assignment
    assert before is not None and before.copies_of == "" and before.run
    outlive(rz, ("a", "c"))              # b's agent is gone: lost; the job waits for a third node
    rz.handle(JOB, JoinRequest(v=1, node_id="b", addr="10.0.0.2", local_world_size=2, master_port=20000,
                             config=fixed, instance="b#2", host="host-b", witness_port=4000, copy_port=4000,
                             copy_verifiers=True,
                             domain="2"),
              7.0, Arrival(secret="secret-b2"))
    r = rz.jobs[JOB].round
    assert r is not None and r.members == ["a", "b", "c"], r
    b = rz.view(JOB, "b", 7.0).assignment
    assert b is not None and b.copies_of == "b" and b.copies_at == Witness(addr="10.0.0.3", port=4000)
    assert b.copies_token == b.copy_token == before.copy_token and b.run == before.run
    assert all(rz.view(JOB, n, 7.0).assignment.copies_of == "" for n in ("a", "c"))    # the others are who they were
    formed = [e for e in rz.jobs[JOB].events if e.kind == "round_completed"][-1]
    assert "b is back at its place (group rank 1) with a new agent" in formed.message, formed.message
    assert "no copy of" not in formed.message


def rejoin(rz: Rendezvous, node: str, now: float, config: JobConfig, incarnation: int, domain: str,
           predecessor: str = "") -> None:
    """`node`'s agent number `incarnation` joins; `predecessor`: the secret its previous agent left in its memory."""
    rz.handle(JOB, JoinRequest(v=1, node_id=node, addr=f"10.0.0.{ord(node) - 96}", local_world_size=2,
                               master_port=20000, config=config, instance=f"{node}#{incarnation}", host=f"host-{node}",
                               witness_port=4000, copy_port=4000, copy_verifiers=True, domain=domain,
                               predecessor=predecessor),
              now, Arrival(secret=f"secret-{node}{incarnation}"))


def test_a_fetch_its_holder_was_lost_during_is_told_again_once_the_holder_is_back() -> None:
    """b's agent restarted without its memory and fetches its copies from c; c's agent dies mid-fetch and comes back
    with its memory (b's copies in it). Before, the next round told b nothing: b held no snapshot, and every rank went
    back to step 0. A member whose poll shows a snapshot of its own is not told again."""
    from protocol.notes import CopiesNote
    fixed = JobConfig(min_nodes=3, max_nodes=3, lease_timeout_s=5.0, last_call_s=0.0)
    for b_holds, told in ((-1, True), (10, False)):
        rz = started({"a": "1", "b": "2", "c": "3"}, fixed)
        outlive(rz, ("a", "c"))
        rejoin(rz, "b", 7.0, fixed, 2, "2")
        b = rz.view(JOB, "b", 7.0).assignment
        assert b is not None and b.copies_of == "b" and b.copies_at == Witness(addr="10.0.0.3", port=4000)
        rz.handle(JOB, PollRequest(v=1, node_id="b", credential="secret-b2", copies=CopiesNote(local_step=b_holds)),
                  8.0)
        for t in (9.0, 10.0, 11.0, 12.0, 13.0, 14.0):     # c's agent is gone: lost, the job waits for a third node
            for n, secret in (("a", "secret-a"), ("b", "secret-b2")):
                rz.handle(JOB, PollRequest(v=1, node_id=n, credential=secret), t)
        rz.tick(rz.next_deadline())
        assert "c" not in rz.jobs[JOB].nodes
        rejoin(rz, "c", 15.0, fixed, 2, "3")                # back, its memory (b's copies) kept
        r = rz.jobs[JOB].round
        assert r is not None and sorted(r.members) == ["a", "b", "c"]
        again = rz.view(JOB, "b", 15.0).assignment
        assert again is not None and (again.copies_of == "b") is told, (b_holds, again.copies_of)
        if told:
            assert again.copies_at == Witness(addr="10.0.0.3", port=4000)


def test_a_holder_is_told_how_many_ranks_each_source_has_and_each_run_is_its_own():
    rz = started({"a": "1", "b": "2", "c": "3"}, CFG)
    c = rz.view(JOB, "c", 1.0).assignment
    assert c is not None and {(x.node_id, x.ranks) for x in c.copy_sources} == {("b", 2)}
    job = rz.jobs[JOB]
    assert c.run == run_of(job) and run_of(msgspec.structs.replace(job, created_at=job.created_at + 1)) != c.run


def test_a_newcomer_of_another_size_takes_the_place_but_not_the_shards():
    rz = started({"a": "1", "b": "2", "c": "3"}, CFG)
    rz.handle(JOB, JoinRequest(v=1, node_id="s", addr="10.0.0.19", local_world_size=1, master_port=20000, config=CFG,
                             instance="s#1", host="host-s", witness_port=4000, copy_port=4000,
                             copy_verifiers=True, domain="4"), 0.5,
                                 Arrival(secret="secret-s"))
    outlive(rz, ("a", "c", "s"))
    r = rz.jobs[JOB].round
    assert r is not None and r.members == ["a", "s", "c"]
    s = rz.view(JOB, "s", 6.0).assignment
    assert s is not None and s.copies_of == "" and s.copies_at is None    # b's ranks 2-3 are not s's rank 2 alone
    formed = [e for e in rz.jobs[JOB].events if e.kind == "round_completed"][-1]
    assert "no copy of b's snapshots is left" in formed.message


def test_racks_in_blocks_spread_their_copies_evenly_and_every_member_has_a_holder():
    wide = JobConfig(min_nodes=2, max_nodes=256, lease_timeout_s=10_000.0, last_call_s=0.0)
    rz = Rendezvous()
    names = [f"n{i:03d}" for i in range(256)]
    for i, n in enumerate(names):                     # racks of 128 in a row, as a switch's nodes come
        rz.handle(JOB, JoinRequest(v=1, node_id=n, addr=f"10.1.{i // 200}.{i % 200}", local_world_size=1,
                                 master_port=1, config=wide, instance=n, witness_port=4000, copy_port=4000,
                                 copy_verifiers=True,
                                 domain="rack-a" if i < 128 else "rack-b"), i * 0.001, Arrival(secret=f"secret-{n}"))
    r = rz.jobs[JOB].round
    assert r is not None and len(r.members) == 256
    held: dict[str, int] = {}
    for n in names:
        a = rz.view(JOB, n, 1.0).assignment
        assert a is not None and len(a.replicas) == 1, n
        held[a.replicas[0].addr] = held.get(a.replicas[0].addr, 0) + 1
    assert max(held.values()) == 1 and len(held) == 256     # each member holds one other's copies


def test_a_spares_fetch_its_holder_was_lost_during_is_told_again_where_the_copies_were() -> None:
    """The gone node b is in no round since: where its copies were is kept with the fetch (a review found the spare
    told nothing again: b's place was looked up in the last round only)."""
    from protocol.notes import CopiesNote
    fixed = JobConfig(min_nodes=3, max_nodes=3, lease_timeout_s=5.0, last_call_s=0.0)
    rz = started({"a": "1", "b": "2", "c": "3"}, fixed)
    join(rz, "s", 0.5, fixed, domain="4")
    for t in (1.0, 2.0, 3.0, 4.0, 5.0):                 # b lost: the spare s takes its place
        for n in ("a", "c", "s"):
            poll(rz, n, t)
    rz.tick(rz.next_deadline())
    r = rz.jobs[JOB].round
    assert r is not None and r.members == ["a", "s", "c"], r
    s = rz.view(JOB, "s", 6.0).assignment
    assert s is not None and s.copies_of == "b" and s.copies_at == Witness(addr="10.0.0.3", port=4000)
    rz.handle(JOB, PollRequest(v=1, node_id="s", credential="secret-s", copies=CopiesNote(local_step=-1)), 6.5)
    for t in (7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0):   # c, holding b's copies, lost mid-fetch
        for n in ("a", "s"):
            poll(rz, n, t)
    rz.tick(rz.next_deadline())
    assert "c" not in rz.jobs[JOB].nodes
    rejoin(rz, "c", 14.0, fixed, 2, "3")                # back, its memory kept
    again = rz.view(JOB, "s", 14.0).assignment
    assert again is not None and again.copies_of == "b" and again.copies_at == Witness(addr="10.0.0.3", port=4000)


def test_a_fetch_told_with_a_cap_is_not_told_again_without_it() -> None:
    """Replicas diverged: the round resumes at most at step 140 and its fetch wants that step. Told again later, a
    fetch would carry no cap and bring back the gone node's newest (the diverged one): it is not kept to be told."""
    fixed = JobConfig(min_nodes=3, max_nodes=3, lease_timeout_s=5.0, last_call_s=0.0)
    rz = started({"a": "1", "b": "2", "c": "3"}, fixed)
    outlive(rz, ("a", "c"))
    rz.jobs[JOB].resume_at_most = 140
    rejoin(rz, "b", 7.0, fixed, 2, "2")
    b = rz.view(JOB, "b", 7.0).assignment
    assert b is not None and b.copies_of == "b" and b.resume_at_most == 140
    assert rz.jobs[JOB].nodes["b"].fetch_of == "" and rz.jobs[JOB].nodes["b"].fetch_place is None


def noted(rz: Rendezvous, node: str, now: float, copied: int, local: int = 50, refused: int = 0) -> NodeStatus:
    return rz.handle(JOB, PollRequest(v=1, node_id=node, credential=f"secret-{node}",
                                      copies=CopiesNote(local_step=local, copied_step=copied, refused=refused)), now)


def test_every_member_is_told_the_oldest_of_the_members_copies_to_keep_snapshots_from():
    """A node lost now is taken over from its copy, which may be snapshots behind where copies are slower than
    snapshots: every member keeps its snapshots from the oldest member's copy on (NodeStatus.copies_floor)."""
    rz = started({"a": "1", "b": "2", "c": "3"}, CFG)
    assert {rz.view(JOB, n, 1.0).copies_floor for n in "abc"} == {0}       # no copy said yet: every step kept
    noted(rz, "a", 1.0, 40)
    noted(rz, "b", 1.1, 30)
    assert rz.view(JOB, "a", 1.1).copies_floor == 0        # c's first copy is still to come
    noted(rz, "c", 1.2, 45)
    assert {rz.view(JOB, n, 1.3).copies_floor for n in "abc"} == {30}
    noted(rz, "b", 1.4, 50)                                 # a rise within HELD_EVERY_S of the last look: lags
    assert rz.view(JOB, "a", 1.4).copies_floor == 30       # (keeps more meanwhile, never less)
    noted(rz, "b", 1.8, 55)
    assert {rz.view(JOB, n, 1.9).copies_floor for n in "abc"} == {40}
    assert noted(rz, "a", 2.0, 40).copies_floor == 40      # the same step again: nothing to recompute
    noted(rz, "c", 2.1, -1, refused=3)                      # (its job went back, and its pushes are refused)
    assert rz.view(JOB, "a", 2.2).copies_floor == 40       # not every snapshot kept for a copy that may not come
    noted(rz, "c", 2.3, -1, local=-1)                       # nothing to copy (no memory directory, say)
    assert rz.view(JOB, "a", 2.4).copies_floor == 40
    off = started({"a": "1", "b": "1"}, CFG)             # one failure domain: no copies, nothing to keep
    noted(off, "a", 1.0, 40)
    assert off.view(JOB, "a", 1.0).copies_floor == -1


def test_a_round_that_makes_no_copies_asks_nobody_to_keep_more():
    rz = started({"a": "1", "b": "1", "c": "2"}, CFG)
    for t, n in enumerate("abc"):
        noted(rz, n, 1.0 + t / 10, 40)
    assert rz.view(JOB, "a", 1.5).copies_floor == 40
    outlive(rz, ("a", "b"))                               # c lost: a and b share a failure domain
    r = rz.jobs[JOB].round
    assert r is not None and r.members == ["a", "b"] and rz.jobs[JOB].copies_off
    assert {rz.view(JOB, n, 6.0).copies_floor for n in "ab"} == {-1}


def test_an_older_agent_holds_no_copies_and_no_holder_is_told_a_token():
    """An agent that does not say it checks verifiers would need its sources' tokens, and a node told another's
    token could act for it for good (a review forged a copy by joining as an "older agent"): it takes no part in
    copies (as an agent with no copy port), and the others' go to the newer ones."""
    rz = Rendezvous()
    for i, (n, new) in enumerate((("a", True), ("b", False), ("c", True))):
        join(rz, n, i * 0.01, CFG, domain=n, verifiers=new)
    if rz.jobs[JOB].state == JobState.WAITING:
        rz.tick(rz.next_deadline())
    told = {n: rz.view(JOB, n, 1.0).assignment for n in "abc"}
    assert all(a is not None for a in told.values())
    assert told["b"].copy_sources == () and told["b"].replicas == ()
    assert all(w.addr != "10.0.0.2" for a in told.values() for w in a.replicas) and told["a"].replicas
    sources = [s for a in told.values() for s in a.copy_sources]
    assert sources and all(s.token == "" and s.verifier for s in sources), sources


def test_a_member_whose_copy_stopped_moving_under_refusals_leaves_the_floor_after_a_minute():
    """Its copy landed once, its pushes are refused since (a full holder): counted a minute (a push may be slow),
    then left out, so the others do not keep every snapshot after its old step (a re-run found 52 a rank)."""
    rz = started({"a": "1", "b": "2", "c": "3"}, CFG)
    noted(rz, "a", 1.0, 40)
    noted(rz, "b", 1.1, 30)
    noted(rz, "c", 1.2, 45)
    assert noted(rz, "b", 30.0, 30, refused=5).copies_floor == 30
    assert noted(rz, "a", 61.0, 40).copies_floor == 30          # a minute since b's copy moved: not yet
    assert noted(rz, "b", 62.0, 30, refused=9).copies_floor == 40
    assert noted(rz, "b", 70.0, 35, refused=9).copies_floor == 35      # its copy moved again: counted again


def test_a_member_with_snapshots_whose_first_copy_never_comes_leaves_the_floor_after_a_minute():
    """A review: a member that never pushed (its notes: snapshots of its own, no copy, nothing refused) made every
    rank keep every snapshot, 24 a rank after 25 s and growing, until the memory directories were full."""
    rz = started({"a": "1", "b": "2", "c": "3"}, CFG)
    noted(rz, "a", 1.0, 40)
    noted(rz, "b", 1.1, 30)
    assert noted(rz, "c", 1.2, -1, local=45).copies_floor == 0          # its first copy may be under way
    assert noted(rz, "a", 60.0, 40).copies_floor == 0
    assert noted(rz, "c", 70.0, -1, local=95).copies_floor == 30        # a minute with none: left out
    noted(rz, "a", 71.0, 60, local=95)
    assert noted(rz, "b", 71.5, 50, local=95).copies_floor == 50
    assert noted(rz, "c", 72.0, 45, local=95).copies_floor == 45        # it lands: counted again


def test_every_member_is_told_the_oldest_of_the_members_newest_snapshots_copies_or_not():
    """A rank whose write of a snapshot outlasts the interval holds an older newest one than the ranks ahead: those
    keep it (NodeStatus.held_floor), so a failure meanwhile finds a step every rank holds; in a round without copies
    too (one failure domain), where no replica can lend one."""
    rz = started({"a": "1", "b": "1", "c": "1"}, CFG)
    assert rz.jobs[JOB].copies_off and rz.view(JOB, "a", 1.0).held_floor == 0      # nothing said yet: all kept
    noted(rz, "a", 1.0, -1, local=40)
    noted(rz, "b", 1.6, -1, local=35)                  # b's write of 40 still under way
    assert rz.view(JOB, "a", 1.6).held_floor == 0 and rz.view(JOB, "a", 1.6).copies_floor == -1   # c: not yet
    noted(rz, "c", 2.2, -1, local=40)
    assert {rz.view(JOB, n, 2.2).held_floor for n in "abc"} == {35}
    noted(rz, "a", 2.3, -1, local=45)                  # within HELD_EVERY_S of the last look: not worked out again
    assert rz.view(JOB, "a", 2.3).held_floor == 35     # (a floor that lags keeps more, never less)
    noted(rz, "b", 2.9, -1, local=45)
    assert rz.view(JOB, "a", 2.9).held_floor == 40     # c's 40 now the oldest newest
    noted(rz, "c", 3.5, -1, local=45)
    noted(rz, "a", 40.0, -1, local=50)
    noted(rz, "c", 40.6, -1, local=50)
    noted(rz, "a", 70.0, -1, local=55)                 # b's newest lags and has not moved for a minute: its writes
    assert rz.view(JOB, "a", 70.0).held_floor == 50    # fail, and the others keep no more for it


def test_a_member_that_holds_none_keeps_every_step_kept_for_a_minute_then_no_longer():
    """A member that holds no snapshot yet (the round's first is coming) counts as 0 for the round's first minute;
    past it, one that still holds none (no memory directory, a script that takes none) no longer counts."""
    rz = started({"a": "1", "b": "1"}, CFG)
    noted(rz, "a", 1.0, -1, local=40)
    noted(rz, "b", 1.6, -1, local=-1)
    assert rz.view(JOB, "a", 1.6).held_floor == 0
    noted(rz, "a", 62.0, -1, local=45)
    assert rz.view(JOB, "a", 62.0).held_floor == 45


def test_the_held_floor_ends_with_the_job():
    rz = started({"a": "1", "b": "2"}, CFG)
    noted(rz, "a", 1.0, 10, local=40)
    noted(rz, "b", 1.6, 10, local=40)
    assert rz.view(JOB, "a", 1.6).held_floor == 40
    rz.jobs[JOB].state = JobState.SUCCEEDED
    assert rz.view(JOB, "a", 2.0).held_floor == -1


def test_a_new_round_keeps_every_step_until_each_member_has_said_what_it_holds_since():
    """Notes from before a round may be of steps the job went back from; until each member's next note, its ranks
    keep every step (within the limit): the round's first snapshots come before that note."""
    rz = started({"a": "1", "b": "1", "c": "1"}, CFG)
    for t, n in enumerate("abc"):
        noted(rz, n, 0.1 + t / 10, -1, local=40)
    assert rz.view(JOB, "a", 0.5).held_floor == 40
    outlive(rz, ("a", "b"))                               # c lost: a round of a and b
    now = rz.jobs[JOB].round.completed_at
    assert rz.jobs[JOB].round.members == ["a", "b"] and rz.view(JOB, "a", now).held_floor == 0
    noted(rz, "a", now + 1.0, -1, local=40)
    assert rz.view(JOB, "a", now + 1.0).held_floor == 0   # b has not said yet
    noted(rz, "b", now + 2.0, -1, local=35)               # the same notes as before, said again: worked out again
    assert rz.view(JOB, "b", now + 2.0).held_floor == 35


def wanted(rz: Rendezvous, node: str, now: float) -> tuple[str, ...] | None:
    a = rz.view(JOB, node, now).assignment
    assert a is not None
    return a.copies_wanted


def moving(rz: Rendezvous, node: str, now: float) -> tuple[str, ...]:
    a = rz.view(JOB, node, now).assignment
    assert a is not None
    return a.copies_moving


def test_a_gone_nodes_copies_nobody_can_fetch_are_wanted_no_more():
    """A soak review: each replaced node (a new id each time) of a 2-node DDP job left its copies on the survivor,
    which kept them all and then refused the live member's pushes at its limit. A round that shrank without the
    gone node names no place of it, so no later round can tell its copies: its holder is told they are unwanted."""
    elastic = JobConfig(min_nodes=1, max_nodes=2, lease_timeout_s=5.0, last_call_s=0.0)
    rz = started({"a": "1", "b": "2"}, elastic)
    assert wanted(rz, "a", 0.5) == ()
    outlive(rz, ("a",))                  # b lost: a goes on alone, nobody takes b's place
    r = rz.jobs[JOB].round
    assert r is not None and r.members == ["a"], r
    assert wanted(rz, "a", 6.0) == ()    # a drops b's copies: it holds none anyone can ask for


def test_a_lost_nodes_copies_stay_wanted_while_a_fetch_of_them_may_be_told_again():
    """The node taking b's place fetches b's copies; lost before a copy of its own landed, its fetch is the next
    node's: b's copies stay wanted on every round until then (never dropped before its own copies landed)."""
    fixed = JobConfig(min_nodes=3, max_nodes=3, lease_timeout_s=5.0, last_call_s=0.0)
    rz = started({"a": "1", "b": "2", "c": "3"}, fixed)
    join(rz, "s", 0.5, fixed, domain="4")
    outlive(rz, ("a", "c", "s"))         # b lost: s takes its place and fetches b's copies from c
    assert rz.view(JOB, "s", 6.0).assignment.copies_of == "b"
    assert {wanted(rz, n, 6.0) for n in ("a", "s", "c")} == {("b",)}
    rz.handle(JOB, PollRequest(v=1, node_id="s", credential="secret-s", copies=CopiesNote(local_step=-1)), 6.5)
    join(rz, "t", 6.6, fixed, domain="5")
    for t in (7.0, 8.0, 9.0, 10.0, 11.0, 12.0):     # s lost before it held anything: t takes the same fetch
        for n in ("a", "c", "t"):
            poll(rz, n, t)
    rz.tick(rz.next_deadline())
    r = rz.jobs[JOB].round
    assert r is not None and "t" in r.members and "s" not in r.members, r
    assert rz.view(JOB, "t", 13.0).assignment.copies_of == "b"
    assert wanted(rz, "c", 13.0) == ("b",)            # c keeps b's copies; s's (none landed) are nobody's


def test_a_round_of_one_node_says_it_has_no_peer_not_to_set_a_failure_domain_already_set():
    # a review: nodes started with --failure-domain each were told to set it whenever the job ran on one node
    rz = started({"a": "rack-1"}, JobConfig(min_nodes=1, max_nodes=3, lease_timeout_s=5.0, last_call_s=0.0))
    assert rz.jobs[JOB].copies_off.startswith("off: the round has one node"), rz.jobs[JOB].copies_off
    assert "--failure-domain" not in rz.jobs[JOB].copies_off


def test_a_round_after_waiting_names_only_the_gone_places_not_every_member():
    """A review: a job that waited below min_nodes kept every member's place, and copies_wanted named them all, so
    each member's assignment grew with the job (O(nodes) each, O(nodes^2) a round). Only b is gone."""
    fixed = JobConfig(min_nodes=3, max_nodes=3, lease_timeout_s=5.0, last_call_s=0.0)
    rz = started({"a": "1", "b": "2", "c": "3"}, fixed)
    outlive(rz, ("a", "c"))              # b lost: below min, the places kept
    assert rz.jobs[JOB].state == JobState.WAITING and set(rz.jobs[JOB].place_copies) == {"a", "b", "c"}
    join(rz, "s", 6.0, fixed, domain="4")
    if (deadline := rz.next_deadline()) is not None:
        rz.tick(deadline)
    r = rz.jobs[JOB].round
    assert r is not None and r.members == ["a", "s", "c"], r
    assert rz.view(JOB, "s", 7.0).assignment.copies_of == "b"
    assert {wanted(rz, n, 7.0) for n in ("a", "s", "c")} == {("b",)}
    assert wanted(rz, "a", 7.0) is wanted(rz, "c", 7.0)      # one tuple, shared


def note(rz: Rendezvous, node: str, now: float, holder: str) -> None:
    """`node` polls saying its copies of step 10 landed at `holder` (its address and copy port, as its agent says)."""
    copies = CopiesNote(local_step=10, copied_step=10, holder=f"10.0.0.{ord(holder[0]) - 96}:4000")
    rz.handle(JOB, PollRequest(v=1, node_id=node, credential=f"secret-{node}", copies=copies), now)


def test_a_live_members_copy_stays_with_its_old_holder_until_its_new_holder_has_one():
    """A review: racks B A B A (c a d b: c and a, d and b hold each other's copies) and a spare s of rack C. s took
    a's place and the pairing turned: d's copies go to s now, and b dropped d's as the round began, while d's first
    copy to s was on its way. d lost then, its place's state went with it. b keeps d's copies (wanted) until d's
    note says one landed at s, and d's loss fetches from s, then from b."""
    fixed = JobConfig(min_nodes=4, max_nodes=4, lease_timeout_s=5.0, last_call_s=0.0)
    rz = started({"c": "B", "a": "A", "d": "B", "b": "A"}, fixed)
    for n, holder in (("c", "a"), ("a", "c"), ("d", "b"), ("b", "d")):
        note(rz, n, 0.5, holder)
    join(rz, "s", 0.6, fixed, domain="C")
    outlive(rz, ("c", "d", "b", "s"))        # a lost: s takes its place
    assert rz.jobs[JOB].round.ranked == ["c", "s", "d", "b"], rz.jobs[JOB].round
    assert targets(rz, "d", 6.0) == ["10.0.0.19"]          # d's copies go to s now, not b
    assert "d" in wanted(rz, "b", 6.0)                       # b keeps them meanwhile
    # ... while room allows: d is moving (b may drop its copy for a source's push), a, gone, is not (s fetches it)
    assert moving(rz, "b", 6.0) == ("b", "d") and "a" in wanted(rz, "b", 6.0), moving(rz, "b", 6.0)
    join(rz, "t", 6.5, fixed, domain="D")
    for t in (7.0, 8.0, 9.0, 10.0, 11.0, 12.0):            # d lost before its copy landed at s: t takes its place
        for n in ("c", "s", "b"):
            poll(rz, n, t)
    rz.tick(rz.next_deadline())
    a = rz.view(JOB, "t", 13.0).assignment
    assert a is not None and a.copies_of == "d", a
    assert a.copies_at is not None and a.copies_at.addr == "10.0.0.19", a.copies_at     # s first (newer once there)
    assert a.copies_also is not None and a.copies_also.addr == "10.0.0.2", a.copies_also   # then b, which has it
    assert "d" in wanted(rz, "b", 13.0) and "d" not in moving(rz, "b", 13.0)     # gone now: b drops it for no push


def test_a_moved_members_old_holder_lets_its_copies_go_once_its_new_holder_has_one():
    fixed = JobConfig(min_nodes=4, max_nodes=4, lease_timeout_s=5.0, last_call_s=0.0)
    rz = started({"c": "B", "a": "A", "d": "B", "b": "A"}, fixed)
    for n, holder in (("c", "a"), ("a", "c"), ("d", "b"), ("b", "d")):
        note(rz, n, 0.5, holder)
    join(rz, "s", 0.6, fixed, domain="C")
    outlive(rz, ("c", "d", "b", "s"))        # a lost: s takes its place; b holds d's copies until d's land at s
    assert rz.jobs[JOB].copies_moving.keys() == {"d", "b"}, rz.jobs[JOB].copies_moving
    note(rz, "d", 6.0, "s")
    join(rz, "t", 6.5, fixed, domain="A")
    for t in (7.0, 8.0, 9.0, 10.0, 11.0, 12.0):            # b lost: t takes its place, the pairing as it was
        for n in ("c", "d", "s"):
            poll(rz, n, t)
    rz.tick(rz.next_deadline())
    assert rz.jobs[JOB].round.ranked == ["c", "s", "d", "t"], rz.jobs[JOB].round
    assert "d" not in wanted(rz, "c", 13.0) and not rz.jobs[JOB].copies_moving    # d's copy is at s: b's may go


def test_with_two_replicas_a_holder_kept_through_the_turn_is_asked_before_a_stale_old_holder():
    """A review (--replicas 2): racks A A B B C C, a spare of rack D took e's place and d's holders turned from f, b
    to s, f: f held d's newest copy all along, b only the one from before the turn. d's loss fetched from s, then b
    (f not asked: two sources at most), and its ranks resumed older than f's copy, or from nothing where b had none."""
    two = JobConfig(min_nodes=6, max_nodes=6, lease_timeout_s=5.0, last_call_s=0.0, replicas=2)
    rz = started({"a": "A", "b": "A", "c": "B", "d": "B", "e": "C", "f": "C"}, two)
    for n in ("a", "b", "c", "d", "f"):
        note(rz, n, 0.5, "f" if n == "d" else "a")
    join(rz, "s", 0.6, two, domain="D")
    outlive(rz, ("a", "b", "c", "d", "f", "s"))        # e lost: s takes its place
    assert rz.jobs[JOB].round.ranked == ["a", "b", "c", "d", "s", "f"], rz.jobs[JOB].round
    assert sorted(targets(rz, "d", 6.0)) == ["10.0.0.19", "10.0.0.6"]       # s and f now (f and b before)
    join(rz, "t", 6.5, two, domain="B")
    for t in (7.0, 8.0, 9.0, 10.0, 11.0, 12.0):            # d lost before its copy landed at s: t takes its place
        for n in ("a", "b", "c", "s", "f"):
            poll(rz, n, t)
    rz.tick(rz.next_deadline())
    a = rz.view(JOB, "t", 13.0).assignment
    assert a is not None and a.copies_of == "d", a
    asked = {w.addr for w in (a.copies_at, a.copies_also) if w is not None}
    assert "10.0.0.6" in asked, a          # f, which held d's copies before and after the turn


def test_a_moving_members_old_holder_is_told_it_may_make_room_only_once_the_new_copy_landed():
    """A review: the old holder b dropped d's copy (moving: copies_moving) for its source's push as the round began,
    before d's first copy landed at s, and d, lost then with its memory, found no copy anywhere: every rank went back
    to step 0. b is told d's copy landed (NodeStatus.moved_landed) only once d's own note says it is at s."""
    fixed = JobConfig(min_nodes=4, max_nodes=4, lease_timeout_s=5.0, last_call_s=0.0)
    rz = started({"c": "B", "a": "A", "d": "B", "b": "A"}, fixed)
    for n, holder in (("c", "a"), ("a", "c"), ("d", "b"), ("b", "d")):
        note(rz, n, 0.5, holder)
    join(rz, "s", 0.6, fixed, domain="C")
    outlive(rz, ("c", "d", "b", "s"))        # a lost: s takes its place, d's copies go to s now, not b
    assert "d" in moving(rz, "b", 6.0)
    assert rz.view(JOB, "b", 6.0).moved_landed == ()            # d's copy at b is its only one off its host
    note(rz, "d", 6.1, "b")                                      # still b's (its push to s under way)
    assert rz.view(JOB, "b", 6.2).moved_landed == ()
    note(rz, "d", 6.3, "s")                                      # landed at s
    assert rz.view(JOB, "b", 6.4).moved_landed == ("d",)
    assert rz.view(JOB, "c", 6.4).moved_landed == ()             # c never held d's


def fetched(rz: Rendezvous, node: str, now: float) -> tuple[str, ...] | None:
    a = rz.view(JOB, node, now).assignment
    assert a is not None
    return a.copies_fetched


def test_a_lone_loss_soon_after_another_names_only_its_own_fetch_for_spares():
    """A review: b lost, s took its place and fetched b's copies, its own copy not landed yet (b's stay wanted);
    then c lost alone. t, taking c's place, read b in copies_wanted as another loss of the round and fetched the
    copies before c's newest too: a spare it cannot need. copies_fetched names this round's fetches only."""
    fixed = JobConfig(min_nodes=4, max_nodes=4, lease_timeout_s=5.0, last_call_s=0.0)
    rz = started({"a": "1", "b": "2", "c": "3", "d": "4"}, fixed)
    join(rz, "s", 0.5, fixed, domain="5")
    outlive(rz, ("a", "c", "d", "s"))         # b lost: s takes its place
    assert rz.view(JOB, "s", 6.0).assignment.copies_of == "b"
    assert fetched(rz, "s", 6.0) == ("b",)
    rz.handle(JOB, PollRequest(v=1, node_id="s", credential="secret-s",
                               copies=CopiesNote(local_step=20, copied_step=-1)), 6.5)     # fetched; no copy landed
    join(rz, "t", 6.6, fixed, domain="6")
    for t in (7.0, 8.0, 9.0, 10.0, 11.0, 12.0):     # c lost: t takes its place
        for n in ("a", "d", "s", "t"):
            poll(rz, n, t)
    rz.tick(rz.next_deadline())
    assert rz.view(JOB, "t", 13.0).assignment.copies_of == "c"
    assert wanted(rz, "t", 13.0) == ("b", "c")        # b's copies stay kept for s's fetch, not ended
    assert fetched(rz, "t", 13.0) == ("c",)           # but only c's are fetched in this round: no spares
