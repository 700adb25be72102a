"""A review: a DDP job (--nnodes 1:3) ran on node a alone to step 57; b joined, and a's agent was stopped (SIGTERM) as
round 2 began. a's last push never landed at b, and round 3 sent every rank back to step 0. Four rules, each here:
- a holder whose own ranks never stepped takes pushes up to the step the server noted as the round formed
  (Assignment.noted_step), not further (a stolen copy token alone still cannot freeze copies with a far step);
- replicas leaving before they stepped send the newest of an earlier round (the step every rank resumes
  from);
- the server waits for a leaver of a job of replicas where no other member holds a snapshot of its own;
- as it waits, the server tells a gone node's holders the step that node's own last note told
  (NodeStatus.sources_noted), and the leaver sends up to it: its newest, though the round's note lagged."""
from __future__ import annotations

import os
from typing import Any

import msgspec

from node_agent.copies.client import push
from node_agent.copies.store import CopyStore
from node_agent.training import snapshot
from protocol.messages import Assignment, CopySource, JobConfig, LeaveRequest, PollRequest
from protocol.notes import CopiesNote, SourceStep
from protocol.tokens import copy_verifier
from rdzv_server.core.leases import DROP_GRACE_S
from rdzv_server.core.rendezvous import Rendezvous
from tests.unit.test_awaiting import ELASTIC, crash_agent, heard, last_event, snapshots
from tests.unit.test_copies_agent import KEY, agent_side, assignment, holder, pushing, serving
from tests.unit.test_copies_rounds import JOB
from tests.unit.test_copies_rounds import join as copies_join
from tests.unit.test_copies_rounds import poll as copies_poll
from tests.unit.test_copy_store import Everyone
from tests.unit.test_rendezvous import job, join, members, running, view


def told(a: Assignment, **changes: Any) -> Assignment:
    return msgspec.structs.replace(a, **changes)


async def test_a_holder_that_never_stepped_takes_pushes_up_to_the_step_the_server_noted(tmp_path) -> None:
    said: list[str] = []
    b, dirs = agent_side(tmp_path, "b", said)            # a newcomer: no snapshot of its own
    await b.before_spawn(told(assignment(()), noted_step=55), dirs)
    assert b._reach() == 55
    store = CopyStore(str(tmp_path / "held"), 64 * 2**20, Everyone(lambda: KEY), round_now=lambda: 10**6,
                      reach=b._reach)
    store.ahead_wait_s = 0.0
    src = tmp_path / "a"
    src.mkdir()
    path = snapshot.save(b"s55", 55, where=str(src))
    async with serving(store) as at:
        landed = await push(at.addr, at.port, key=KEY, node_id="a", local_rank=0, step=55, path=path, round_id=2)
        assert landed.ok, landed
        far = snapshot.save(b"far", 10**6, where=str(src))
        refused = await push(at.addr, at.port, key=KEY, node_id="a", local_rank=0, step=10**6, path=far, round_id=2)
        assert not refused.ok and "past what the job has reached" in refused.reason, refused
    assert store.held() == {("a", 0): 55}


async def test_replicas_leaving_before_they_stepped_send_the_newest_of_an_earlier_round(tmp_path) -> None:
    import time
    said: list[str] = []
    async with holder(tmp_path) as (store, at):
        for node, resume_at_most in (("a", -1), ("c", 50)):
            copies, dirs = agent_side(tmp_path, node, said)
            for where in dirs.values():
                snapshot.save(b"s55", 55, where=where)        # round 1's, alone: the step round 2 resumes from
                os.utime(snapshot.path(55, where), (time.time() - 5, time.time() - 5))
            await copies.before_spawn(told(assignment(()), ranks_alike=True, resume_at_most=resume_at_most), dirs)
            pushing(copies, at, dirs)
            await copies._scan()
            assert (node, 0) not in store.held()             # running: only once its ranks stepped, as before
            await copies.close()                             # stopped before its workers stepped
        # Diverged replicas (resume_at_most) send nothing: their newest may be a step the job abandons
        assert store.held() == {("a", 0): 55, ("a", 1): 55}


async def _leaver_of_245_and_250(tmp_path, server_heard: bool) -> dict:
    """a, alone in round 1, holds 245 and 250 (keep=2) and stops before its round-2 workers stepped; b, never
    stepped, was told the round noted 245 and nothing else. What b holds of a then."""
    import time
    said: list[str] = []
    b, _ = agent_side(tmp_path, "b", said)
    await b.before_spawn(told(assignment(()), noted_step=245), {})
    store = CopyStore(str(tmp_path / "held"), 64 * 2**20, Everyone(lambda: KEY), round_now=lambda: 10**6,
                      reach=b._reach)
    store.ahead_wait_s = 0.0
    async with serving(store) as at:
        a, dirs = agent_side(tmp_path, "a", said)
        for where in dirs.values():
            for step in (245, 250):
                snapshot.save(b"s%d" % step, step, where=where)
                os.utime(snapshot.path(step, where), (time.time() - 5, time.time() - 5))
        await a.before_spawn(told(assignment(()), ranks_alike=True, noted_step=245), dirs)
        if server_heard:
            a.heard(a.note())
        pushing(a, at, dirs, round_id=2)
        await a.close()
    return store.held()


async def test_a_leaver_of_replicas_sends_no_step_past_the_one_the_server_noted(tmp_path) -> None:
    # a fourth review: a's workers saved step 250 after the server noted 245 as round 2 formed; b, never stepped,
    # parked 250 as "ahead" past a's flush, and round 3 sent every rank back to step 0
    assert await _leaver_of_245_and_250(tmp_path, server_heard=False) == {("a", 0): 245, ("a", 1): 245}


def test_a_leaver_of_replicas_whose_others_hold_no_snapshot_is_awaited() -> None:
    rz = running(["a", "b", "c"], ELASTIC)
    job(rz).progress.alike_step, job(rz).progress.all_alike = 10, True
    crash_agent(rz, "a", 10.0)                      # a alone noted a snapshot: b and c never stepped
    rz.tick(10.0 + DROP_GRACE_S)
    assert job(rz).awaited == ["a"] and job(rz).round is None
    # why a job of replicas waits (a review: the line said only "an agent restarting keeps its place")
    assert "the ranks are replicas, but only the memory of node a holds a snapshot" in job(rz).reason, job(rz).reason


def test_a_round_tells_its_members_the_newest_step_they_noted() -> None:
    rz = running(["a", "b", "c"], ELASTIC)
    snapshots(rz, "a", 5.0, step=55)
    crash_agent(rz, "c", 10.0, held=False)          # held nothing: not awaited, the round forms without it
    rz.tick(10.0 + DROP_GRACE_S)
    assert members(rz) == ["a", "b"]
    got = view(rz, "b", 11.0).assignment
    assert got is not None and got.noted_step == 55, got


def test_a_job_of_replicas_growing_from_one_node_is_not_told_every_rank_goes_back() -> None:
    # a review: DDP (--nnodes 1:3) on node a alone, then b joined: the round said "its ranks hold their own state
    # ... every rank resumes from the script's own checkpoint, or from step 0", though b is lent a's replica and
    # every rank resumed from memory (the lone-holder wait's rule had leaked into what the round says)
    config = JobConfig(min_nodes=1, max_nodes=3, max_restarts=3, lease_timeout_s=5.0, last_call_s=3.0)
    rz = running(["a"], config)
    job(rz).progress.alike_step, job(rz).progress.all_alike = 10, True
    snapshots(rz, "a", 1.0, step=55)
    join(rz, "b", 7.0, config)
    heard(rz, "a", 7.0)
    rz.tick(7.0 + config.last_call_s)
    assert members(rz) == ["a", "b"]
    grown = last_event(rz, "round_completed")
    assert "own state" not in grown, grown


def test_a_job_of_replicas_going_on_after_a_lone_holders_wait_is_not_told_its_ranks_hold_their_own_state() -> None:
    # a real run (DDP, b with --no-memory-dir, a's agent SIGKILLed): after the wait the round said "the job shrinks
    # ... its ranks hold their own state: when it grows again ... every rank resumes from step 0": a rank of
    # replicas that joins is lent the step
    rz = running(["a", "b", "c"], ELASTIC)
    job(rz).progress.alike_step, job(rz).progress.all_alike = 10, True
    crash_agent(rz, "a", 10.0)
    rz.tick(10.0 + DROP_GRACE_S)
    assert job(rz).awaited == ["a"]
    end = job(rz).last_call_deadline
    assert end is not None
    heard(rz, "bc", end - 1.0)
    rz.tick(end)
    assert sorted(members(rz)) == ["b", "c"]
    shrunk = last_event(rz, "round_completed")
    assert "own state" not in shrunk, shrunk


# A fifth review: the round's noted step lagged a's newest by more than its ranks keep (snapshots a step apart),
# so a held no step at or before it and sent nothing: round 3 resumed from step 0. The rule since: the server tells
# a gone source's holders the step that source's own last note told (NodeStatus.sources_noted), the holder takes
# that source's push up to it, and the leaver sends up to what the server heard from it.

def lone_holder_leaves(step: int) -> Rendezvous:
    """DDP on a alone (step 245 noted), b joined (round 2); a told `step` and was stopped before its ranks stepped."""
    config = JobConfig(min_nodes=1, max_nodes=3, max_restarts=3, lease_timeout_s=5.0, last_call_s=3.0)
    rz = Rendezvous()
    copies_join(rz, "a", 0.0, config, domain="fa", credential="secret-a")
    rz.tick(3.0)
    rz.jobs[JOB].progress.alike_step, rz.jobs[JOB].progress.all_alike = 10, True
    rz.handle(JOB, PollRequest(v=1, node_id="a", credential="secret-a", copies=CopiesNote(local_step=245)), 4.0)
    copies_join(rz, "b", 5.0, config, domain="fb", credential="secret-b")
    copies_poll(rz, "a", 7.0)
    rz.tick(8.0)
    assert rz.jobs[JOB].round is not None and rz.jobs[JOB].round.members == ["a", "b"]
    b = copies_poll(rz, "b", 8.0).assignment
    assert b is not None and b.noted_step == 245 and [s.node_id for s in b.copy_sources] == ["a"]
    rz.handle(JOB, PollRequest(v=1, node_id="a", credential="secret-a", copies=CopiesNote(local_step=step)), 8.5)
    rz.handle(JOB, LeaveRequest(v=1, node_id="a", credential="secret-a", stopped=True, stop_timeout_s=3.0), 8.6)
    assert rz.jobs[JOB].awaited == ["a"] and rz.jobs[JOB].round is None
    return rz


def test_a_lone_holders_holder_is_told_the_step_its_last_note_told_while_the_job_waits() -> None:
    rz = lone_holder_leaves(270)
    waiting = copies_poll(rz, "b", 8.7)
    assert waiting.assignment is None and waiting.sources_noted == (SourceStep(node_id="a", step=270),), waiting
    b_says = CopiesNote(local_step=10**6)      # a node's own note moves no other node's step
    rz.handle(JOB, PollRequest(v=1, node_id="b", credential="secret-b", copies=b_says), 8.8)
    assert copies_poll(rz, "b", 8.9).sources_noted == (SourceStep(node_id="a", step=270),)
    rz.tick(rz.jobs[JOB].last_call_deadline or 30.0)      # a not back: b goes on alone, and the word goes with the wait
    r = rz.jobs[JOB].round
    assert r is not None and r.members == ["b"] and copies_poll(rz, "b", 31.0).sources_noted == ()


async def test_a_leaver_whose_newest_is_past_the_noted_step_by_more_than_it_keeps_sends_what_it_told(tmp_path) -> None:
    import time
    said: list[str] = []
    b, _ = agent_side(tmp_path, "b", said)
    sources = tuple(CopySource(node_id=n, verifier=copy_verifier(KEY), ranks=2) for n in "ac")
    await b.before_spawn(told(assignment(()), round_id=2, noted_step=245, copy_sources=sources), {})
    store = b._holder_store()
    assert store is not None
    store.ahead_wait_s = 0.5
    async with serving(store) as at:
        a, dirs = agent_side(tmp_path, "a", said)
        for where in dirs.values():
            for step in (265, 270):                   # round 1's, alone, keep=2: 245 long gone
                snapshot.save(b"s%d" % step, step, where=where)
                os.utime(snapshot.path(step, where), (time.time() - 5, time.time() - 5))
        await a.before_spawn(told(assignment(()), ranks_alike=True, noted_step=245), dirs)
        a.heard(a.note())                               # its poll before its leave: the server heard 270
        b.told((SourceStep(node_id="a", step=270),))    # b's poll answered as the job waits for a
        pushing(a, at, dirs, round_id=2)
        await a.close()                                 # stopped before its round-2 workers stepped
        assert store.held() == {("a", 0): 270, ("a", 1): 270}, said
        # the server's word is of node a only: another node's push past what the job reached stays refused
        (tmp_path / "c").mkdir()
        far = snapshot.save(b"far", 271, where=str(tmp_path / "c"))
        refused = await push(at.addr, at.port, key=KEY, node_id="c", local_rank=0, step=271, path=far, round_id=2)
        assert not refused.ok and "past what the job has reached" in refused.reason, refused


async def test_a_leaver_sends_the_noted_step_first_for_a_holder_that_is_not_told(tmp_path) -> None:
    # an older holder agent (or an older server) tells it nothing: the step the round noted still lands there,
    # though the server heard 250
    assert await _leaver_of_245_and_250(tmp_path, server_heard=True) == {("a", 0): 245, ("a", 1): 245}


def test_a_member_leaving_while_the_job_waits_for_nodes_has_its_holders_told_its_step() -> None:
    """A review: a fixed-size job of replicas waited for nodes (c lost), and a, one of the last round's, was stopped
    meanwhile: no round ran as it went, so its last note's step was not kept and its holder b never told it (its
    last push past the round's noted step refused, as in the fifth review above)."""
    config = JobConfig(min_nodes=3, max_nodes=3, max_restarts=3, lease_timeout_s=5.0, last_call_s=3.0)
    rz = Rendezvous()
    for n in "abc":
        copies_join(rz, n, 0.0, config, domain=f"f{n}")
    rz.tick(3.0)
    b = copies_poll(rz, "b", 3.0).assignment
    assert b is not None and [s.node_id for s in b.copy_sources] == ["a"]
    rz.jobs[JOB].progress.alike_step, rz.jobs[JOB].progress.all_alike = 10, True
    rz.handle(JOB, PollRequest(v=1, node_id="a", credential="secret-a", copies=CopiesNote(local_step=270)), 4.0)
    rz.connection_dropped(JOB, "c", 5.0, heard=True)
    copies_poll(rz, "a", 5.0 + DROP_GRACE_S), copies_poll(rz, "b", 5.0 + DROP_GRACE_S)
    rz.tick(5.0 + DROP_GRACE_S)
    assert rz.jobs[JOB].round is None           # below min_nodes: the job waits for nodes
    rz.handle(JOB, LeaveRequest(v=1, node_id="a", credential="secret-a", stopped=True, stop_timeout_s=3.0), 7.0)
    assert copies_poll(rz, "b", 7.1).sources_noted == (SourceStep(node_id="a", step=270),)
