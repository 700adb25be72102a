"""A member whose agent restarts keeps its place (rdzv_server/core/awaiting.py): an elastic job waits for it, bounded,
rather than shrinking (the survivors behind it would take other ranks, and per-rank state would be dropped: a review
saw every rank go back to step 0). Pure core, time as plain floats."""
from __future__ import annotations

import msgspec
import pytest

from protocol.bounds import MAX_PREPARE_S
from protocol.messages import JobConfig, JobState, JoinRequest, NodeState, PollRequest
from protocol.notes import CopiesNote
from rdzv_server.core.awaiting import window_s
from rdzv_server.core.leases import DROP_GRACE_S
from rdzv_server.core.rendezvous import Rendezvous, RendezvousError
from rdzv_server.core.requests import Arrival
from tests.unit import test_copies_rounds as copies
from tests.unit.test_rendezvous import JOB, job, join, members, poll, running, view

ELASTIC = JobConfig(min_nodes=2, max_nodes=3, max_restarts=3, lease_timeout_s=5.0, last_call_s=3.0)
WINDOW = window_s(ELASTIC)


def snapshots(rz, node: str, now: float, step: int = 10, ready: bool = True, copied: int | None = None) -> None:
    """`node`'s poll tells that its ranks hold an in-memory snapshot of `step` (CopiesNote.local_step), and, with
    `copied`, the newest step copied to a peer."""
    note = CopiesNote(local_step=step, copying=False) if copied is None else \
        CopiesNote(local_step=step, copied_step=copied, holder="127.0.0.1:9")
    rz.handle(JOB, PollRequest(v=1, node_id=node, ready=ready, copies=note), now)


def crash_agent(rz, node: str, now: float, held: bool = True, copied: int | None = None) -> None:
    """`node`'s agent process ends (SIGKILL, OOM): its host closes the held poll's connection; the others poll on.
    `held`: its memory held a snapshot of its own (step 10), as its polls told; `copied`: its newest copy's step."""
    if held:
        snapshots(rz, node, now - 0.5, copied=copied)
    for n in job(rz).nodes:
        if n != node:
            poll(rz, n, now)
    rz.connection_dropped(JOB, node, now, heard=True)


def heard(rz, nodes: str, *times: float) -> None:
    """`nodes` poll at each of `times` (their leases run while the job waits)."""
    for t in times:
        for n in nodes:
            poll(rz, n, t)


def every_agent_restarted():
    """A running job of a, b and c whose agents all restart 0.1 s apart (an upgrade), each memory holding a
    snapshot: their hosts close the held polls, and the job falls below min awaiting them."""
    rz = running(["a", "b", "c"], ELASTIC)
    for n in "abc":
        snapshots(rz, n, 9.5)
    for n, t in (("a", 10.0), ("b", 10.1), ("c", 10.2)):
        rz.connection_dropped(JOB, n, t, heard=True)
    rz.tick(10.2 + DROP_GRACE_S)
    return rz


def last_event(rz, kind: str) -> str:
    return next(e.message for e in reversed(job(rz).events) if e.kind == kind)


def test_a_member_whose_agent_restarts_keeps_its_place_and_every_rank_its_ranks():
    rz = running(["a", "b", "c"], ELASTIC)
    crash_agent(rz, "b", 10.0)
    rz.tick(10.0 + DROP_GRACE_S)                 # lost: the job would shrink to a, c (c taking b's ranks)
    assert "b" not in job(rz).nodes and job(rz).round is None and job(rz).state == JobState.WAITING
    assert job(rz).awaited == ["b"] and job(rz).last_call_deadline == pytest.approx(10.0 + DROP_GRACE_S + WINDOW)
    said = last_event(rz, "round_waiting")
    assert f"waiting up to {WINDOW:g}s for node b to come back" in said and "going on with 2 nodes" in said, said
    assert view(rz, "a", 12.0).node_state == view(rz, "c", 12.0).node_state == NodeState.WAITING
    join(rz, "b", 13.0, ELASTIC, instance="b#2")         # the new agent, ready
    assert members(rz) == ["a", "b", "c"] and job(rz).restart_count == 0
    assert "b is back at its place (group rank 1) with a new agent" in last_event(rz, "round_completed")
    assert job(rz).awaited == [] and job(rz).last_call_deadline is None


def test_a_new_agent_that_joins_before_its_predecessor_is_lost_takes_the_place_in_the_same_request():
    rz = running(["a", "b", "c"], ELASTIC)
    first = job(rz).round.round_id
    crash_agent(rz, "b", 10.0)
    join(rz, "b", 10.2, ELASTIC, instance="b#2")          # within the drop's grace: the old record is replaced
    assert members(rz) == ["a", "b", "c"] and job(rz).round.round_id == first + 1     # never a round without it
    assert "waiting up to" in last_event(rz, "round_waiting")


def test_a_member_not_back_within_the_window_is_gone_on_without():
    rz = running(["a", "b", "c"], ELASTIC)
    crash_agent(rz, "b", 10.0)
    rz.tick(10.0 + DROP_GRACE_S)
    deadline = job(rz).last_call_deadline
    heard(rz, "ac", 14.0, deadline - 0.01)
    rz.tick(deadline - 0.01)
    assert job(rz).round is None
    rz.tick(deadline)
    assert members(rz) == ["a", "c"] and job(rz).awaited == [] and job(rz).restart_count == 0
    said = last_event(rz, "round_completed")
    assert f"node b not back within {WINDOW:g}s of its agent's end: going on with 2 nodes" in said, said
    assert job(rz).events[-1].data["cause"] == "node_lost"


def test_one_back_still_preparing_is_waited_for_as_long_as_its_agent_waits_and_forms_the_round_once_ready():
    """Two make test runs under load: b's new agent joined as the wait began and its warm interpreter took 5 s,
    then 7 s, of a 4 s window (two windows were allowed after the first); the job went on without it, and a rank
    went back to step 0. One back is waited for as long as its agent waits for its warm interpreter."""
    rz = running(["a", "b", "c"], ELASTIC)
    crash_agent(rz, "b", 10.0)
    rz.tick(10.0 + DROP_GRACE_S)
    back = 10.0 + DROP_GRACE_S + WINDOW - 1.0
    heard(rz, "ac", 14.0, back)
    join(rz, "b", back, ELASTIC, instance="b#2", ready=False)     # its warm interpreter still imports
    assert job(rz).round is None
    assert job(rz).last_call_deadline == pytest.approx(10.0 + DROP_GRACE_S + 2 * WINDOW + MAX_PREPARE_S)
    left = 10.0 + DROP_GRACE_S + 2 * WINDOW + MAX_PREPARE_S - back
    assert job(rz).reason == f"node b back, its workers preparing; waiting up to {left:g}s for node b to be ready " \
                             "(an agent restarting keeps its place)", job(rz).reason
    slow = 10.0 + DROP_GRACE_S + 2 * WINDOW + 5.0               # past two windows: the first fix's bound
    for t in (back + 2.0, back + 6.0, back + 10.0, slow):
        heard(rz, "ac", t)
        poll(rz, "b", t, ready=False)                             # its lease runs on while it prepares
    rz.tick(slow)
    assert job(rz).round is None and job(rz).awaited == ["b"]
    poll(rz, "b", slow + 0.5, ready=True)
    assert members(rz) == ["a", "b", "c"]


def test_one_still_preparing_when_its_agent_would_start_cold_is_gone_on_without_and_the_event_says_so():
    """Its agent says it is ready within MAX_PREPARE_S (cold, if its warm interpreter is not): one that never
    does is not waited for past that."""
    rz = running(["a", "b", "c"], ELASTIC)
    crash_agent(rz, "b", 10.0)
    rz.tick(10.0 + DROP_GRACE_S)
    back, end = 12.0, 10.0 + DROP_GRACE_S + 2 * WINDOW + MAX_PREPARE_S
    join(rz, "b", back, ELASTIC, instance="b#2", ready=False)
    t = back
    while t < end:
        for n in "abc":
            poll(rz, n, t, ready=n != "b")
        t += 2.0
    rz.tick(end - 0.01)
    assert job(rz).round is None
    rz.tick(end)
    assert members(rz) == ["a", "c"] and view(rz, "b", end).node_state == NodeState.WAITING
    said = last_event(rz, "round_completed")
    assert "node b back but still preparing at the wait's end: going on with 2 nodes" in said, said


@pytest.mark.parametrize("how", ["lease", "keepalive"])
def test_a_host_gone_silent_is_not_awaited(how):
    """A lease run out, or a held poll's connection closed by the keepalive (no ACK lately): the host is gone, not
    its agent restarting; the job goes on at once."""
    rz = running(["a", "b", "c"], ELASTIC)
    first = job(rz).round.round_id
    for t in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0):
        for n in "ac":
            poll(rz, n, t)
    if how == "keepalive":
        rz.connection_dropped(JOB, "b", 6.0, heard=False)
    rz.tick(rz.next_deadline())
    assert members(rz) == ["a", "c"] and job(rz).round.round_id == first + 1 and job(rz).awaited == []


@pytest.mark.parametrize("back", [True, False])
def test_a_spare_takes_a_restarting_nodes_place_only_when_the_wait_runs_out(back):
    """b's copy at a peer holds its newest snapshot, as its last note says: the spare used to take its place at once.
    A review found that note a second behind the snapshots (every rank one snapshot back), the copy's holder lost in
    the same event, or b holding copies only it serves (step 0). b's agent, back in seconds, has everything: it is
    awaited; the spare takes the place when the wait runs out."""
    rz = running(["a", "b", "c"], ELASTIC)
    join(rz, "s", 1.0, ELASTIC)
    crash_agent(rz, "b", 10.0, copied=10)
    poll(rz, "s", 10.0)
    rz.tick(10.0 + DROP_GRACE_S)
    assert job(rz).round is None and job(rz).awaited == ["b"] and job(rz).spares == ["s"]
    assert "spare s stays spare while b's agent restarts" in last_event(rz, "round_waiting")
    if back:
        join(rz, "b", 12.0, ELASTIC, instance="b#2")
        assert members(rz) == ["a", "b", "c"] and job(rz).spares == ["s"]
        return
    heard(rz, "acs", 12.0, 14.0, 16.0, 18.0, 20.0)
    rz.tick(10.0 + DROP_GRACE_S + WINDOW + 0.1)
    assert members(rz) == ["a", "s", "c"] and job(rz).awaited == []


@pytest.mark.parametrize("copied", [5, -1])
def test_a_spare_does_not_take_the_place_from_a_copy_older_than_the_restarting_nodes_memory(copied):
    """A review (2:3 with a ready spare, b's copies pushed at 16 MiB/s): b's agent was killed with its copy at step 5
    and its memory at 25; the spare took b's place at once and every rank went back to 5 (or, with no copy landed
    yet, to step 0), where b's own agent, back in seconds, had 25. b is awaited; back, it keeps its place and the
    spare stays spare. Not back within the window, the spare takes the place from the copy."""
    for back in (True, False):
        rz = running(["a", "b", "c"], ELASTIC)
        join(rz, "s", 1.0, ELASTIC)
        crash_agent(rz, "b", 10.0, copied=copied)
        heard(rz, "acs", 10.0)
        rz.tick(10.0 + DROP_GRACE_S)
        assert job(rz).round is None and job(rz).awaited == ["b"] and job(rz).spares == ["s"]
        copy = "its copy of step 5" if copied == 5 else \
            "no copy its agent has told of (none landed yet, or its new agent pushed none yet)"
        assert f"spare s stays spare: it would resume b's ranks from {copy}, where b's own newest is step " \
            in last_event(rz, "round_waiting"), last_event(rz, "round_waiting")    # an operator asks why
        if back:
            join(rz, "b", 12.0, ELASTIC, instance="b#2")
            assert members(rz) == ["a", "b", "c"] and job(rz).spares == ["s"]
            assert "b is back at its place" in last_event(rz, "round_completed")
        else:
            heard(rz, "acs", 12.0, 14.0, 16.0, 18.0, 20.0)
            rz.tick(10.0 + DROP_GRACE_S + WINDOW + 0.1)
            assert members(rz) == ["a", "s", "c"] and job(rz).awaited == []


def test_a_node_whose_memory_held_no_snapshot_is_not_awaited():
    """Nothing of its own to lose (no protect, no Snapshots): the job goes on at the smaller size at once, as an
    elastic job whose agent was killed for good should (issue 4: within about a second)."""
    rz = running(["a", "b", "c"], ELASTIC)
    crash_agent(rz, "b", 10.0, held=False)
    rz.tick(10.0 + DROP_GRACE_S)
    assert members(rz) == ["a", "c"] and job(rz).awaited == []


def test_a_job_of_replicas_is_not_made_to_wait():
    """DDP: the ranks' digests agreed (their snapshots are replicas), so a rank without the step is lent it by
    another after the job grows again; shrinking loses nothing (the others hold the snapshot too: one that alone
    holds any is awaited, test_lone_holder.py)."""
    rz = running(["a", "b", "c"], ELASTIC)
    job(rz).progress.alike_step, job(rz).progress.all_alike = 10, True
    heard(rz, "ac", 9.0)
    snapshots(rz, "a", 9.0)
    snapshots(rz, "c", 9.0)
    crash_agent(rz, "b", 10.0)
    rz.tick(10.0 + DROP_GRACE_S)
    assert members(rz) == ["a", "c"] and job(rz).awaited == []


def test_a_job_of_replicas_within_each_shard_only_is_made_to_wait():
    """A review (HSDP, 2 nodes x 2 ranks, 2 replicas of 2 shards, nnodes 1:2): its digests agree within each shard,
    which set `alike_step` as DDP's do, and the job shrank when an agent was killed and restarted: every rank from
    step 0. No rank is lent another's shard (the ranks are not all replicas): the node is awaited."""
    rz = running(["a", "b", "c"], ELASTIC)
    job(rz).progress.alike_step = 10            # agreed in each shard's group, not across every rank
    crash_agent(rz, "b", 10.0)
    rz.tick(10.0 + DROP_GRACE_S)
    assert job(rz).round is None and job(rz).awaited == ["b"]
    join(rz, "b", 11.0, ELASTIC, instance="b#2")
    assert members(rz) == ["a", "b", "c"] and "b is back at its place" in last_event(rz, "round_completed")


@pytest.mark.parametrize("replicas", [False, True])
def test_a_job_of_per_rank_state_that_changes_size_says_every_rank_goes_back_when_it_grows(replicas):
    """A host gone silent is not awaited (a lease, not a restart): the job shrinks, and when the node returns it
    grows into ranks no snapshot in memory is of: every rank resumes from disk or step 0. Both rounds say so, with
    what keeps the job's size; a job of replicas (DDP) loses nothing and is told nothing."""
    rz = running(["a", "b", "c"], ELASTIC)
    if replicas:
        job(rz).progress.alike_step, job(rz).progress.all_alike = 10, True
    for n in "abc":
        snapshots(rz, n, 1.0)
    heard(rz, "ac", 3.0, 5.0)
    rz.tick(1.0 + ELASTIC.lease_timeout_s)                    # b silent for a lease: lost, not awaited
    assert members(rz) == ["a", "c"] and job(rz).awaited == []
    shrunk = last_event(rz, "round_completed")
    join(rz, "b", 7.0, ELASTIC, instance="b#2")
    heard(rz, "ac", 7.0)
    rz.tick(7.0 + ELASTIC.last_call_s)
    assert members(rz) == ["a", "c", "b"]
    grown = last_event(rz, "round_completed")
    if replicas:
        assert "own state" not in shrunk + grown, (shrunk, grown)
        return
    assert "the job shrinks from 3 to 2 nodes and its ranks hold their own state" in shrunk, shrunk
    assert f"`rdzv-ctl resize {JOB} --nnodes 2:2` keeps this one" in shrunk, shrunk
    assert "the job grows from 2 to 3 nodes and its ranks hold their own state: no snapshot in memory is of the " \
        "new ranks, so every rank resumes from the script's own checkpoint, or from step 0" in grown, grown


def test_a_new_agent_of_a_node_that_held_nothing_replaces_it_without_a_wait():
    rz = running(["a", "b", "c"], ELASTIC)
    crash_agent(rz, "b", 10.0, held=False)
    join(rz, "b", 10.2, ELASTIC, instance="b#2")
    assert "round_waiting" not in [e.kind for e in job(rz).events]
    assert members(rz) == ["a", "c", "b"]         # shrunk, then grown: b joins last


def test_a_fixed_size_job_waits_for_nodes_as_before():
    fixed = JobConfig(min_nodes=3, max_nodes=3, lease_timeout_s=5.0, last_call_s=3.0)
    rz = running(["a", "b", "c"], fixed)
    crash_agent(rz, "b", 10.0)
    rz.tick(10.0 + DROP_GRACE_S)
    assert job(rz).round is None and "< min 3" in last_event(rz, "round_waiting")
    assert job(rz).last_call_deadline is None          # no wait of its own: for nodes, up to join_timeout
    join(rz, "b", 14.0, fixed, instance="b#2")
    assert members(rz) == ["a", "b", "c"]


def test_two_restarts_within_the_window_are_awaited_and_a_third_is_a_flapping_hosts():
    """A review (2:3, each rank its own state): two OOM kills of one agent within exclude_window_s made the second
    a flapping host's; the job shrank, and grew back when the hold-off ended with every rank from step 0. A restart
    gets one loss more than exclude_lost_after before it is damped; a crash loop is still bounded: the third loss
    is not awaited, and the node is kept out when it comes back."""
    rz = running(["a", "b", "c"], ELASTIC)
    for i, t in enumerate((10.0, 20.0)):
        crash_agent(rz, "b", t)                   # (its new agent's polls tell its snapshot)
        rz.tick(t + DROP_GRACE_S)
        assert job(rz).round is None and job(rz).awaited == ["b"], i
        join(rz, "b", t + 2.0, ELASTIC, instance=f"b#{i + 2}")
        assert view(rz, "b", t + 2.0).node_state != NodeState.EXCLUDED, i      # not held off: it was awaited
        assert members(rz) == ["a", "b", "c"], i
    crash_agent(rz, "b", 30.0)
    rz.tick(30.0 + DROP_GRACE_S)
    assert members(rz) == ["a", "c"] and job(rz).awaited == []
    join(rz, "b", 32.0, ELASTIC, instance="b#4")
    assert view(rz, "b", 32.0).node_state == NodeState.EXCLUDED


@pytest.mark.parametrize("everyone", [False, True])
def test_members_restarting_together_below_min_keep_their_places_when_enough_are_back(everyone):
    """A review (2:3, each rank its own state): c's and b's agents killed 0.3 s apart: the job fell below min and
    forgot whom it waited for; c back, a last call of 1 s formed a, c (c in b's place), and b, back a moment later,
    grew the job: every rank from step 0. (The same for every agent of a job restarted at once, an upgrade.) Those
    awaited are still awaited below min: once enough are back, the others' wait resumes within its bound."""
    rz = running(["a", "b", "c"], ELASTIC)
    gone = "cba" if everyone else "cb"
    for n in "abc":
        snapshots(rz, n, 9.5)
    for n, t in zip(gone, (10.0, 10.3, 10.4)[:len(gone)], strict=True):
        rz.connection_dropped(JOB, n, t, heard=True)
    heard(rz, "" if everyone else "a", 10.4)
    rz.tick(10.4 + DROP_GRACE_S)
    assert job(rz).round is None and sorted(job(rz).awaited) == (["a", "b", "c"] if everyone else ["b", "c"])
    if everyone:
        join(rz, "a", 11.0, ELASTIC, instance="a#2")
    heard(rz, "a", 11.5)
    join(rz, "c", 11.5, ELASTIC, instance="c#2")                 # back: min reached, b still away
    assert job(rz).round is None and job(rz).last_call_deadline > 11.5 + ELASTIC.last_call_s
    heard(rz, "ac", 12.5)
    join(rz, "b", 12.8, ELASTIC, instance="b#2", ready=False)    # back, its warm interpreter importing
    heard(rz, "ac", 13.5)
    rz.tick(11.5 + ELASTIC.last_call_s + 0.01)                   # a last call's end: still waiting
    assert job(rz).round is None
    poll(rz, "b", 14.0, ready=True)
    assert members(rz) == ["a", "b", "c"], [e.message for e in job(rz).events[-4:]]
    assert view(rz, "b", 14.0).node_state == NodeState.MEMBER
    assert "shrinks" not in last_event(rz, "round_completed")


def test_a_flapping_hosts_hold_off_ends_when_the_job_is_short_of_nodes_with_a_member_awaited():
    """c, flapping, is held off while a and b train; b's agent restarts: below min with b awaited, the job is short
    of nodes, so c's hold-off ends (else the job would stand still for it); b never comes back: a and c go on."""
    rz = running(["a", "b", "c"], ELASTIC)
    t = 1.0
    for flap in (1, 2):                                   # c silent for a lease (not awaited), then back
        for _ in range(6):
            heard(rz, "ab", t)
            t += 1.0
            rz.tick(t)
        assert "c" not in job(rz).nodes, flap
        join(rz, "c", t, ELASTIC, instance=f"c#{flap + 1}")
        heard(rz, "ab", t)
        rz.tick(t + ELASTIC.last_call_s)
        t += ELASTIC.last_call_s
    assert view(rz, "c", t).node_state == NodeState.EXCLUDED and members(rz) == ["a", "b"]
    crash_agent(rz, "b", t)
    rz.tick(t + DROP_GRACE_S)
    assert job(rz).round is None and job(rz).awaited == ["b"]
    assert any("exclusion as a flapping host ends" in e.message for e in job(rz).events)
    for step in range(1, 40):
        heard(rz, "ac", t + step)
        rz.tick(t + step)
    assert members(rz) == ["a", "c"], [e.message for e in job(rz).events[-5:]]


def test_a_survivor_lost_while_the_job_waits_leaves_the_job_waiting_for_nodes_and_the_awaited_one_at_its_place():
    """c (nothing of its own) lost while the job waits for b: below min, the job waits for nodes (no deadline but
    join_timeout); b, still awaited, back at its place forms the round at once."""
    rz = running(["a", "b", "c"], ELASTIC)
    crash_agent(rz, "b", 10.0)
    rz.tick(10.0 + DROP_GRACE_S)
    rz.connection_dropped(JOB, "c", 12.0, heard=True)
    poll(rz, "a", 12.0)
    rz.tick(12.0 + DROP_GRACE_S)
    assert "c" not in job(rz).nodes and job(rz).awaited == ["b"] and job(rz).last_call_deadline is None
    assert job(rz).state == JobState.WAITING and job(rz).join_deadline is not None   # for nodes, up to join_timeout
    assert job(rz).reason.endswith("waiting for nodes"), job(rz).reason
    join(rz, "b", 13.0, ELASTIC, instance="b#2")
    assert members(rz) == ["a", "b"] and "node b back" in last_event(rz, "round_completed")


def two_spares_and_b_lost() -> tuple[JobConfig, Rendezvous]:
    """A fixed-size job of a, b and c (copies on, each its own domain) with spares s and t; b lost: s takes its
    place (and is told to fetch b's copies)."""
    fixed = JobConfig(min_nodes=3, max_nodes=3, lease_timeout_s=5.0, last_call_s=0.0)
    rz = copies.started({"a": "1", "b": "2", "c": "3"}, fixed)
    copies.join(rz, "s", 0.5, fixed, domain="4")
    copies.join(rz, "t", 0.6, fixed, domain="5")
    for t in (1.0, 2.0, 3.0, 4.0, 5.0):
        for n in ("a", "c", "s", "t"):
            copies.poll(rz, n, t)
    rz.tick(rz.next_deadline())
    return fixed, rz


def test_a_spares_fetch_holder_whose_agent_restarts_is_awaited_even_with_another_spare():
    """s took b's place and fetches b's copies from c; c's agent restarts mid-fetch. Another spare t could take c's
    place, but s would then hold nothing and every rank go back to step 0: c is awaited, and tells s again."""
    fixed, rz = two_spares_and_b_lost()
    assert rz.jobs[copies.JOB].round.members == ["a", "s", "c"]
    rz.handle(copies.JOB, PollRequest(v=1, node_id="s", credential="secret-s", copies=CopiesNote(local_step=-1)), 6.0)
    rz.handle(copies.JOB, PollRequest(v=1, node_id="c", credential="secret-c", copies=CopiesNote(local_step=10)), 6.0)
    for n in ("a", "t"):
        copies.poll(rz, n, 6.0)
    rz.connection_dropped(copies.JOB, "c", 6.0, heard=True)
    rz.tick(6.0 + DROP_GRACE_S)
    assert rz.jobs[copies.JOB].round is None and rz.jobs[copies.JOB].awaited == ["c"]
    assert rz.jobs[copies.JOB].spares == ["t"]             # t takes c's place only if c is not back in time
    copies.rejoin(rz, "c", 8.0, fixed, 2, "3")          # back, its memory (b's copies) kept
    r = rz.jobs[copies.JOB].round
    assert r is not None and r.members == ["a", "s", "c"]
    again = rz.view(copies.JOB, "s", 8.0).assignment
    assert again is not None and again.copies_of == "b" and again.copies_at.addr == "10.0.0.3"
    assert rz.jobs[copies.JOB].spares == ["t"]


def test_a_fetch_holder_not_back_in_time_has_its_place_taken_by_the_spare_waiting():
    fixed, rz = two_spares_and_b_lost()
    rz.handle(copies.JOB, PollRequest(v=1, node_id="s", credential="secret-s", copies=CopiesNote(local_step=-1)), 6.0)
    rz.handle(copies.JOB, PollRequest(v=1, node_id="c", credential="secret-c", copies=CopiesNote(local_step=10)), 6.0)
    rz.connection_dropped(copies.JOB, "c", 6.0, heard=True)
    for n in ("a", "s", "t"):
        copies.poll(rz, n, 6.5)
    rz.tick(6.0 + DROP_GRACE_S)
    deadline = rz.jobs[copies.JOB].last_call_deadline
    assert deadline == pytest.approx(6.0 + DROP_GRACE_S + window_s(fixed))
    for n in ("a", "s", "t"):
        copies.poll(rz, n, deadline - 0.5)
    rz.tick(deadline)
    r = rz.jobs[copies.JOB].round
    assert r is not None and r.members == ["a", "s", "t"] and rz.jobs[copies.JOB].spares == []


def test_an_agent_crashing_again_as_it_starts_ends_the_wait():
    """b's new instances keep dying while their warm interpreters import (each replaced by the next within the
    drop's grace, or lost): the job goes on without b at the latest two windows after the wait began, not never
    (a review held a job 44 s, and would have for as long as the loop ran)."""
    for replaced in (True, False):
        rz = running(["a", "b", "c"], ELASTIC)
        crash_agent(rz, "b", 10.0)
        rz.tick(10.0 + DROP_GRACE_S)
        began, t = 10.0 + DROP_GRACE_S, 12.0
        for i in range(6):
            if job(rz).round is not None:
                break
            join(rz, "b", t, ELASTIC, instance=f"b#{i + 2}", ready=False)     # back, preparing
            heard(rz, "ac", t + 1.0)
            rz.tick(t + 1.0)
            if not replaced:
                rz.connection_dropped(JOB, "b", t + 1.5, heard=True)         # dies again while importing
                heard(rz, "ac", t + 1.5 + DROP_GRACE_S)
                rz.tick(t + 1.5 + DROP_GRACE_S)
            t += 3.0
        if job(rz).round is None:
            heard(rz, "ac", began + 2 * WINDOW)
            rz.tick(began + 2 * WINDOW)
        assert job(rz).round is not None and "b" not in members(rz), (replaced, members(rz), job(rz).awaited)
        assert job(rz).events[-1].t <= began + 2 * WINDOW


def test_with_flap_damping_off_a_crash_loop_is_still_bounded_by_two_windows():
    cfg = JobConfig(min_nodes=2, max_nodes=3, max_restarts=3, lease_timeout_s=5.0, last_call_s=3.0,
                    exclude_lost_after=0)
    rz = running(["a", "b", "c"], cfg)
    crash_agent(rz, "b", 10.0)
    rz.tick(10.0 + DROP_GRACE_S)
    began, window = 10.0 + DROP_GRACE_S, window_s(cfg)
    t = 12.0
    while t < began + 2 * window:
        join(rz, "b", t, cfg, instance=f"b#{t}", ready=False)
        snapshots(rz, "b", t + 0.1, ready=False)     # its memory holds its snapshot: a restart each time
        heard(rz, "ac", t + 1.0)
        rz.connection_dropped(JOB, "b", t + 1.0, heard=True)
        rz.tick(t + 1.0 + DROP_GRACE_S)
        t += 2.5
    heard(rz, "ac", began + 2 * window)
    rz.tick(began + 2 * window)
    assert job(rz).round is not None and members(rz) == ["a", "c"]


WIDE = JobConfig(min_nodes=2, max_nodes=4, max_restarts=3, lease_timeout_s=5.0, last_call_s=3.0)


def b_and_c_crash(c_at: float):
    """A 2:4 job of a, b, c, d whose b and c hold snapshots: b's agent dies at 10.0, c's at `c_at`; b is lost."""
    rz = running(["a", "b", "c", "d"], WIDE)
    for n in "bc":
        snapshots(rz, n, 9.5)
    heard(rz, "ad", 10.0)
    rz.connection_dropped(JOB, "b", 10.0, heard=True)
    rz.connection_dropped(JOB, "c", c_at, heard=True)
    rz.tick(10.0 + DROP_GRACE_S)
    return rz, WIDE


def test_a_member_lost_while_the_job_waits_for_another_is_awaited_too():
    """2:4, b and then c lost 0.3 s apart: before, the round formed on b's return with d closed up over c's place
    (every rank to step 0 in a review's run)."""
    rz, cfg = b_and_c_crash(10.3)
    assert job(rz).awaited == ["b"]
    heard(rz, "ad", 11.2)
    rz.tick(10.3 + DROP_GRACE_S)
    assert job(rz).awaited == ["b", "c"] and job(rz).round is None
    b_then_c_back(rz, cfg)


def b_then_c_back(rz, cfg: JobConfig) -> None:
    """b's and c's next agents join in turn: no round while c is not back, then every node at its place."""
    join(rz, "b", 12.0, cfg, instance="b#2")
    assert job(rz).round is None
    join(rz, "c", 12.5, cfg, instance="c#2")
    assert members(rz) == ["a", "b", "c", "d"]


def b_back_preparing_and_c_away():
    """2:4, b and c awaited; b's next agent is back, preparing: the wait's end moves past its two windows."""
    rz, cfg = b_and_c_crash(10.3)
    heard(rz, "ad", 11.2)
    rz.tick(10.3 + DROP_GRACE_S)
    bound = job(rz).awaited_since + 2 * window_s(cfg)
    heard(rz, "ad", 12.0)
    join(rz, "b", 12.0, cfg, instance="b#2", ready=False)
    assert job(rz).awaited == ["b", "c"] and job(rz).last_call_deadline == pytest.approx(bound + MAX_PREPARE_S)
    return rz, cfg, bound


def test_one_back_preparing_and_lost_again_ends_the_extra_time_another_awaited_one_still_has_its_window():
    """b back and preparing moves the wait's end past two windows; b's new agent dies too (a second loss: still
    awaited, its memory its predecessor's, but no longer preparing): neither has more than two windows from the
    wait's start."""
    rz, cfg, bound = b_back_preparing_and_c_away()
    said = job(rz).reason
    assert "waiting up to" in said and "for node c to come back and node b to be ready" in said, said
    heard(rz, "ad", 13.0)
    rz.connection_dropped(JOB, "b", 13.0, heard=True)
    rz.tick(13.0 + DROP_GRACE_S)
    assert job(rz).awaited == ["b", "c"] and job(rz).last_call_deadline <= bound
    heard(rz, "ad", 15.0, bound)
    rz.tick(bound)
    assert members(rz) == ["a", "d"]


def test_one_that_left_while_the_job_waits_is_not_awaited():
    cfg = JobConfig(min_nodes=2, max_nodes=4, max_restarts=3, lease_timeout_s=5.0, last_call_s=3.0)
    rz = running(["a", "b", "c", "d"], cfg)
    crash_agent(rz, "b", 10.0)
    rz.tick(10.0 + DROP_GRACE_S)
    from tests.unit.test_rendezvous import leave
    leave(rz, "c", 11.5)
    assert job(rz).awaited == ["b"]
    join(rz, "b", 12.0, cfg, instance="b#2")
    assert members(rz) == ["a", "b", "d"]


def waiting_for_b() -> object:
    rz = running(["a", "b", "c"], ELASTIC)
    crash_agent(rz, "b", 10.0)
    rz.tick(10.0 + DROP_GRACE_S)
    assert job(rz).awaited == ["b"]
    return rz


def test_a_resize_during_the_wait_keeps_it_while_the_places_fit():
    """A second review: `resize` formed the round at once, c closed up over b's place (every rank to step 0)."""
    rz = waiting_for_b()
    rz.resize(JOB, 2, 4, 11.5)
    assert job(rz).round is None and job(rz).awaited == ["b"]
    join(rz, "b", 12.0, ELASTIC, instance="b#2")
    assert members(rz) == ["a", "b", "c"]
    rz = waiting_for_b()
    rz.resize(JOB, 1, 2, 11.5)                     # the places no longer fit: the resize decides
    assert members(rz) == ["a", "c"] and job(rz).awaited == []


def test_a_job_that_shrinks_after_every_agent_restarted_says_so():
    """A review: every agent restarted (an upgrade), c not back in time: a and b's new records had told nothing
    of their memory yet, and the round where the job shrank said nothing (only the growth later did)."""
    rz = every_agent_restarted()
    join(rz, "a", 11.5, ELASTIC, instance="a#2")
    join(rz, "b", 11.6, ELASTIC, instance="b#2")
    end = job(rz).last_call_deadline
    heard(rz, "ab", 13.0, end)
    rz.tick(end)
    assert members(rz) == ["a", "b"]
    assert "the job shrinks from 3 to 2 nodes and its ranks hold their own state" in last_event(rz, "round_completed")


def test_a_resize_of_a_job_short_of_nodes_with_a_member_awaited_goes_on_within_the_waits_bound():
    """A review: fixed size 3, c's agent killed for good (awaited below min, no wait running); the operator
    resized to 2:3 and nothing happened until the join timeout failed the job. The wait resumes at the resize and
    ends within its bound."""
    fixed = JobConfig(min_nodes=3, max_nodes=3, lease_timeout_s=5.0, last_call_s=3.0, join_timeout_s=40.0)
    rz = running(["a", "b", "c"], fixed)
    crash_agent(rz, "c", 10.0)
    rz.tick(10.0 + DROP_GRACE_S)
    assert job(rz).awaited == ["c"] and job(rz).last_call_deadline is None
    rz.resize(JOB, 2, 3, 13.0)
    end = job(rz).last_call_deadline
    assert end is not None and end <= 10.0 + DROP_GRACE_S + 2 * window_s(fixed)
    heard(rz, "ab", 15.0, end)
    rz.tick(end)
    assert members(rz) == ["a", "b"] and job(rz).state == JobState.RUNNING


def test_one_back_preparing_while_the_job_is_short_keeps_its_time_when_the_wait_resumes():
    """Every agent restarted (an upgrade): b back but still preparing while the job is short; once a and c are back
    the wait resumes with the time a node preparing gets (MAX_PREPARE_S past the bound), as when the job is not
    short."""
    rz = every_agent_restarted()
    assert sorted(job(rz).awaited) == ["a", "b", "c"] and job(rz).last_call_deadline is None
    join(rz, "b", 11.5, ELASTIC, instance="b#2", ready=False)
    join(rz, "a", 11.6, ELASTIC, instance="a#2")
    join(rz, "c", 11.7, ELASTIC, instance="c#2")
    assert job(rz).round is None
    assert job(rz).last_call_deadline == pytest.approx(job(rz).awaited_since + 2 * WINDOW + MAX_PREPARE_S)
    poll(rz, "b", 20.0, ready=True)
    assert members(rz) == ["a", "b", "c"]


def test_a_newcomer_that_fills_max_during_the_wait_stays_spare_until_the_awaited_one_is_back():
    """A review (2:3 with a spare, every member restarted together): the first one back as a spare and the others
    filled max_nodes while a member awaited was still preparing, and the round formed at once with the spare in its
    place: every rank from step 0. A newcomer during a wait waits as a spare; it gets the place only if the wait
    ends without the member."""
    rz = waiting_for_b()
    join(rz, "d", 11.0, ELASTIC)                   # ready: a, c and d fill max_nodes
    assert job(rz).round is None and job(rz).awaited == ["b"]
    join(rz, "b", 12.0, ELASTIC, instance="b#2")
    assert members(rz) == ["a", "b", "c"] and view(rz, "d", 12.0).node_state == NodeState.SPARE
    rz = waiting_for_b()
    join(rz, "d", 11.0, ELASTIC)
    end = job(rz).last_call_deadline
    heard(rz, "acd", 12.0, end)
    rz.tick(end)                                   # b not back: d takes its place
    assert members(rz) == ["a", "d", "c"]


def test_an_awaited_member_back_waits_at_its_place_whoever_else_is_ready():
    """The same review's other run: a spare still preparing when a and c restarted together, ready before they
    were back; c, back, was benched as a spare (max_nodes looked full) and its place went to the spare at the
    wait's end: every rank from step 0. An awaited member back always waits at its place."""
    rz = running(["a", "b", "c"], ELASTIC)
    join(rz, "d", 1.0, ELASTIC, ready=False)              # a spare, its workers still preparing
    for n in "ac":
        snapshots(rz, n, 9.5)
    heard(rz, "b", 9.5, 10.0)
    poll(rz, "d", 10.0, ready=False)
    for n in "ac":
        rz.connection_dropped(JOB, n, 10.0, heard=True)
    rz.tick(10.0 + DROP_GRACE_S)
    assert job(rz).round is None and sorted(job(rz).awaited) == ["a", "c"]
    poll(rz, "d", 11.2, ready=True)                       # ready now: b and d could form a round of min 2
    join(rz, "c", 11.5, ELASTIC, instance="c#2")
    assert view(rz, "c", 11.5).node_state == NodeState.WAITING
    join(rz, "a", 12.0, ELASTIC, instance="a#2")
    assert members(rz) == ["a", "b", "c"] and view(rz, "d", 12.0).node_state == NodeState.SPARE


def test_a_drain_while_the_job_is_short_says_it_waits_for_nodes():
    """A review: the reason said "waiting up to 0s" for a job short of nodes, where no wait runs."""
    rz = every_agent_restarted()
    rz.drain_node(JOB, "c", "bad host", 12.0)
    assert job(rz).reason.startswith("node c drained; waiting for nodes, and for nodes a, b to come back"), \
        job(rz).reason


def test_an_awaited_node_drained_ends_the_wait():
    rz = waiting_for_b()
    rz.drain_node(JOB, "b", "bad host", 11.5)
    assert job(rz).awaited == [] and job(rz).last_call_deadline == 11.5
    heard(rz, "ac", 11.5)
    rz.tick(11.5)
    assert members(rz) == ["a", "c"]


def test_the_round_forms_once_the_rest_awaited_are_back_and_one_is_given_up():
    rz, cfg = b_and_c_crash(10.0)
    join(rz, "c", 11.5, cfg, instance="c#2", ready=False)      # back, preparing (no snapshot told yet)
    join(rz, "b", 12.0, cfg, instance="b#2")                   # back, ready
    assert job(rz).round is None
    join(rz, "c", 12.4, cfg, instance="c#3", ready=False)      # c's agent crashed again as it started: awaited
    assert job(rz).awaited == ["b", "c"] and job(rz).round is None
    join(rz, "c", 12.5, cfg, instance="c#4", ready=False)      # and again: a third loss, a flapping host
    assert job(rz).awaited == ["b"] and job(rz).last_call_deadline == 12.5     # b is back: the next tick forms
    heard(rz, "abd", 12.5)
    rz.tick(12.5)
    assert members(rz) == ["a", "b", "d"] and "(node b back)" in last_event(rz, "round_completed")


def test_a_server_away_during_the_wait_moves_its_bound_too():
    rz = waiting_for_b()
    deadline, since = job(rz).last_call_deadline, job(rz).awaited_since
    rz.restored(42.0, 30.0, clean=False)
    assert job(rz).last_call_deadline == deadline + 30.0 and job(rz).awaited_since == since + 30.0
    back = job(rz).last_call_deadline - 1.0
    heard(rz, "ac", back)
    join(rz, "b", back, ELASTIC, instance="b#2", ready=False)
    assert job(rz).last_call_deadline == pytest.approx(since + 30.0 + 2 * WINDOW + MAX_PREPARE_S)   # as without it


def test_an_agent_restarted_while_the_server_was_away_keeps_its_place():
    """After a restart every lease runs anew, so b's new instance was refused (its record looked alive) until the old
    lease ran out, and then b was taken for a host gone silent: c took its ranks (a second review). A record not
    heard from since the server came back is taken over by a new instance of its agent that shows the old agent's
    secret (from the node's memory), its place kept for it."""
    cfg = JobConfig(min_nodes=2, max_nodes=3, max_restarts=3, lease_timeout_s=5.0, last_call_s=3.0)
    rz = copies.started({"a": "1", "b": "2", "c": "3"}, cfg)

    def snap(n: str, t: float) -> None:
        rz.handle(copies.JOB, PollRequest(v=1, node_id=n, credential=f"secret-{n}",
                                          copies=CopiesNote(local_step=10, copying=False)), t)
    for n in "abc":
        snap(n, 9.5)
    rz.restored(20.0, 10.0, clean=False)
    t, refused = 20.5, 0
    while True:
        for n in "ac":
            snap(n, t)
        rz.tick(t)
        try:
            copies.rejoin(rz, "b", t, cfg, 2, "2", predecessor="secret-b")
            break
        except RendezvousError:
            refused += 1
            t += 0.7
    assert refused == 0
    r = rz.jobs[copies.JOB].round
    assert r is not None and r.members == ["a", "b", "c"], (r, [e.message for e in rz.jobs[copies.JOB].events[-4:]])


@pytest.mark.parametrize("shown", ["", "secret-a", "guess"])
def test_a_node_unheard_since_the_server_came_back_is_not_taken_without_its_agents_secret(shown):
    """A review: any holder of the agent token joined as b with a new instance right after a server restart, took b's
    place, and b's own agent stopped (taken over): every rank from step 0. A successor shows the old agent's secret;
    without it (or with another node's) the join is a conflict and changes nothing."""
    cfg = JobConfig(min_nodes=2, max_nodes=3, max_restarts=3, lease_timeout_s=5.0, last_call_s=3.0)
    rz = copies.started({"a": "1", "b": "2", "c": "3"}, cfg)
    rz.restored(20.0, 10.0, clean=False)
    before = msgspec.to_builtins(rz.jobs[copies.JOB])
    with pytest.raises(RendezvousError) as refused:
        copies.rejoin(rz, "b", 20.5, cfg, 9, "2", predecessor=shown)
    assert refused.value.code == "node_conflict"
    assert msgspec.to_builtins(rz.jobs[copies.JOB]) == before


def test_an_agents_next_instance_with_its_secret_takes_a_live_records_place_at_once():
    """b's agent restarted and its end not yet noticed (its record live): its next agent shows the old secret and
    takes the place at once, awaited as a restart, instead of a conflict until the old lease runs out."""
    cfg = JobConfig(min_nodes=2, max_nodes=3, max_restarts=3, lease_timeout_s=5.0, last_call_s=3.0)
    rz = copies.started({"a": "1", "b": "2", "c": "3"}, cfg)
    rz.handle(copies.JOB, PollRequest(v=1, node_id="b", credential="secret-b",
                                      copies=CopiesNote(local_step=10, copying=False)), 1.0)
    copies.rejoin(rz, "b", 1.5, cfg, 2, "2", predecessor="secret-b")
    assert "node b restarted (new agent instance)" in [e.message for e in rz.jobs[copies.JOB].events]
    r = rz.jobs[copies.JOB].round
    assert r is not None and r.members == ["a", "b", "c"], [e.message for e in rz.jobs[copies.JOB].events[-4:]]


def test_a_record_heard_since_the_server_came_back_is_not_taken_over():
    """Only one not heard from since the restore: a live agent's id taken by another instance is still a conflict
    (two agents given one --node-id), and the refusal changes nothing."""
    cfg = JobConfig(min_nodes=2, max_nodes=3, max_restarts=3, lease_timeout_s=5.0, last_call_s=3.0)
    rz = copies.started({"a": "1", "b": "2", "c": "3"}, cfg)
    rz.restored(20.0, 10.0, clean=False)
    copies.poll(rz, "b", 20.5)                           # b's own agent is heard
    before = msgspec.to_builtins(rz.jobs[copies.JOB])
    with pytest.raises(RendezvousError) as refused:
        copies.rejoin(rz, "b", 21.0, cfg, 2, "2")
    assert refused.value.code == "node_conflict"
    assert msgspec.to_builtins(rz.jobs[copies.JOB]) == before


def test_a_member_unheard_since_the_server_came_back_is_awaited_when_its_lease_runs_out():
    """b's agent was stopped (or killed) while the server was away, and its next agent is slower than a lease to join
    after the server is back: nobody heard how b ended, so its place is kept for a window (before: a host gone
    silent, c closed up over b's ranks: every rank from step 0)."""
    cfg = JobConfig(min_nodes=2, max_nodes=3, max_restarts=3, lease_timeout_s=5.0, last_call_s=3.0)
    rz = copies.started({"a": "1", "b": "2", "c": "3"}, cfg)
    for n in "abc":
        rz.handle(copies.JOB, PollRequest(v=1, node_id=n, credential=f"secret-{n}",
                                          copies=CopiesNote(local_step=10, copying=False)), 9.5)
    rz.restored(20.0, 10.0, clean=False)
    for t in (22.0, 25.0, 28.0, 31.0):
        for n in "ac":
            copies.poll(rz, n, t)
    rz.tick(31.0)                                     # b's lease, renewed at the restore for the time away, is out
    record = rz.jobs[copies.JOB]
    assert record.round is None and record.awaited == ["b"], [e.message for e in record.events[-3:]]
    copies.rejoin(rz, "b", 33.0, cfg, 2, "2")
    assert record.round is not None and record.round.members == ["a", "b", "c"]


def test_one_back_preparing_and_then_ready_ends_its_extra_time_and_the_reason_says_who_is_left():
    """A review: b's extra time outlived its preparation, and c, gone for good, held the job to bound + 60 s."""
    rz, cfg, bound = b_back_preparing_and_c_away()
    heard(rz, "ad", 13.0)
    poll(rz, "b", 13.0, ready=True)
    assert job(rz).round is None and job(rz).last_call_deadline == pytest.approx(bound)
    said = job(rz).reason
    assert said.startswith("node b back and ready; waiting up to") and said.count("node") == 2 and \
        "for node c to come back (" in said, said


def test_one_ready_past_the_others_two_windows_forms_the_round_at_once():
    rz, cfg, bound = b_back_preparing_and_c_away()
    t = 13.0
    while t < bound + 5.0:
        heard(rz, "ad", t)
        poll(rz, "b", t, ready=False)
        t += 2.0
    heard(rz, "ad", bound + 5.0)
    poll(rz, "b", bound + 5.0, ready=True)
    rz.tick(bound + 5.0)
    assert members(rz) == ["a", "b", "d"]
    assert "node c not back within" in last_event(rz, "round_completed")


def test_the_reason_stops_naming_one_back_and_ready_or_drained_as_away():
    rz, cfg, bound = b_back_preparing_and_c_away()
    heard(rz, "ad", 13.0)
    join(rz, "c", 13.0, cfg, instance="c#2")                 # c back and ready, b still preparing
    assert job(rz).round is None
    said = job(rz).reason
    assert said.startswith("node c back and ready;") and "for node b to be ready (" in said, said
    rz, cfg, bound = b_back_preparing_and_c_away()
    heard(rz, "ad", 13.0)
    rz.drain_node(JOB, "c", "bad host", 13.0)                # c, away, drained: b alone is waited for
    said = job(rz).reason
    assert job(rz).round is None and job(rz).awaited == ["b"], said
    assert said.startswith("node c drained; waiting up to") and "for node b to be ready (" in said, said


@pytest.mark.parametrize("nodes", ["3", "2:3"])
def test_a_spare_whose_agent_restarts_mid_fetch_is_awaited_and_told_to_fetch_again(nodes):
    """A review: b lost, the spare s took its place and fetched b's copies; s's agent was killed and started again
    before the fetch ended. Its new agent was told to fetch its own copies (it had none: every rank went back to
    step 0), and an elastic job did not wait for it (its polls had told no snapshot). s's place holds b's copies:
    s is awaited, and its new agent is told to fetch b's again."""
    lo, hi = (int(x) for x in (nodes.split(":") if ":" in nodes else (nodes, nodes)))
    config = JobConfig(min_nodes=lo, max_nodes=hi, lease_timeout_s=5.0, last_call_s=0.0)
    rz = copies.started({"a": "1", "b": "2", "c": "3"}, config)
    copies.join(rz, "s", 0.5, config, domain="4")
    for t in (1.0, 2.0, 3.0, 4.0, 5.0):                 # b lost: the spare s takes its place
        for n in ("a", "c", "s"):
            copies.poll(rz, n, t)
    rz.tick(rz.next_deadline())
    assert rz.jobs[copies.JOB].round.members == ["a", "s", "c"]
    told = rz.view(copies.JOB, "s", 5.5).assignment
    assert told is not None and told.copies_of == "b"
    rz.handle(copies.JOB, PollRequest(v=1, node_id="s", credential="secret-s", copies=CopiesNote(local_step=-1)), 6.0)
    for n in ("a", "c"):
        copies.poll(rz, n, 6.0)
    rz.connection_dropped(copies.JOB, "s", 6.0, heard=True)       # its agent killed mid-fetch
    rz.tick(6.0 + DROP_GRACE_S)
    assert rz.jobs[copies.JOB].round is None and "s" not in rz.jobs[copies.JOB].nodes
    if ":" in nodes:
        assert rz.jobs[copies.JOB].awaited == ["s"]
    copies.rejoin(rz, "s", 7.5, config, 2, "4")          # its new agent
    r = rz.jobs[copies.JOB].round
    assert r is not None and r.members == ["a", "s", "c"]
    again = rz.view(copies.JOB, "s", 7.5).assignment
    assert again is not None and again.copies_of == "b" and again.copies_at.addr == told.copies_at.addr
    assert rz.jobs[copies.JOB].unfinished_fetches == {}


def test_a_second_spare_in_the_place_of_one_lost_mid_fetch_fetches_what_it_was_fetching():
    """The next review: b lost, the spare s took its place and fetched b's copies; s was lost for good mid-fetch and
    the second spare t took s's place: it was told to fetch s's own copies (none), and every rank went to step 0. It
    is told to fetch b's, from where s was told."""
    fixed, rz = two_spares_and_b_lost()
    told = rz.view(copies.JOB, "s", 5.5).assignment
    assert told is not None and told.copies_of == "b"
    rz.handle(copies.JOB, PollRequest(v=1, node_id="s", credential="secret-s", copies=CopiesNote(local_step=-1)), 6.0)
    for n in ("a", "c", "t"):
        copies.poll(rz, n, 6.0)
    rz.connection_dropped(copies.JOB, "s", 6.0, heard=True)       # lost for good mid-fetch
    for t in (6.5, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0):
        for n in ("a", "c", "t"):
            copies.poll(rz, n, t)
        rz.tick(t)
    r = rz.jobs[copies.JOB].round
    assert r is not None and r.members == ["a", "t", "c"], r
    got = rz.view(copies.JOB, "t", 15.0).assignment
    assert got is not None and got.copies_of == "b" and got.copies_at.addr == told.copies_at.addr


@pytest.mark.parametrize("workers", [2, 1])
def test_a_member_back_with_another_number_of_workers_says_every_rank_goes_back(workers):
    """b's new agent runs 2 workers where it ran 1 (its --nproc-per-node changed, or a GPU fewer under `gpu`): the
    ranks after its first move and the world size changes, so no snapshot in memory is of them. A review found
    every rank back at step 0 with nothing said; the round says it now. Back with as many workers: nothing said."""
    rz = running(["a", "b", "c"], ELASTIC)
    crash_agent(rz, "b", 10.0)
    rz.tick(10.0 + DROP_GRACE_S)
    join(rz, "b", 12.0, ELASTIC, instance="b#2", lws=workers)
    formed = last_event(rz, "round_completed")
    assert members(rz) == ["a", "b", "c"] and "b is back at its place" in formed
    if workers == 1:
        assert "ranks move" not in formed, formed
        return
    assert "node b runs 2 workers where it ran 1: the world size goes from 3 to 4 and ranks move; the job's ranks " \
        "hold their own state, so no snapshot in memory is of them and every rank resumes from the script's own " \
        "checkpoint, or from step 0" in formed, formed


def test_the_last_member_back_with_fewer_workers_says_its_last_ranks_go_not_that_ranks_move():
    """(A review): the last node, c, back with 1 worker where it ran 2: no rank moves, every other rank resumes from
    its memory, and rank 5 goes with its state: the round says that, not "ranks move ... from step 0"."""
    rz = running(["a", "b", "c"], ELASTIC, lws=2)
    crash_agent(rz, "c", 10.0)
    rz.tick(10.0 + DROP_GRACE_S)
    join(rz, "c", 12.0, ELASTIC, instance="c#2", lws=1)
    formed = last_event(rz, "round_completed")
    assert members(rz) == ["a", "b", "c"] and "ranks move" not in formed, formed
    assert "node c runs 1 worker where it ran 2: the world size goes from 6 to 5; no rank moves, but the job's " \
        "ranks hold their own state and rank 5 and the state it held is gone" in formed, formed


@pytest.mark.parametrize("hsdp", [False, True])
@pytest.mark.parametrize("spare_workers", [1, 2])
def test_a_member_back_with_another_number_of_workers_gives_its_place_to_a_spare_of_its_old_size(spare_workers,
                                                                                                 hsdp):
    """A review (3 x 2 shard job, a ready spare of 2 workers, copies landed): b's agent restarted with
    --nproc-per-node 1. The spare stayed spare while b was awaited ("its memory holds b's newest state"), then b came
    back with 1 worker, took its place, the ranks moved and every rank went back to step 0, where the spare, taking
    b's place from its copy, kept the job's size and every rank's state. A spare of b's old size (here 1 worker, b's
    new agent 2) takes the place now; b waits as the spare. One of another size does not: b is back at its place.
    `hsdp`: the job's digests agreed within each shard only (HSDP): its ranks still hold their own shards."""
    rz = running(["a", "b", "c"], ELASTIC)
    if hsdp:
        job(rz).progress.alike_step = 10
    join(rz, "s", 1.0, ELASTIC, lws=spare_workers)
    crash_agent(rz, "b", 10.0, copied=10)
    poll(rz, "s", 10.0)
    rz.tick(10.0 + DROP_GRACE_S)
    assert job(rz).round is None and job(rz).awaited == ["b"] and job(rz).spares == ["s"]
    join(rz, "b", 12.0, ELASTIC, instance="b#2", lws=2)
    formed = last_event(rz, "round_completed")
    if spare_workers == 1:
        assert members(rz) == ["a", "s", "c"] and job(rz).spares == ["b"], (members(rz), formed)
        assert "s takes b's place (group rank 1)" in formed and "ranks move" not in formed, formed
        assert job(rz).restart_count == 0
    else:
        assert members(rz) == ["a", "b", "c"] and job(rz).spares == ["s"], (members(rz), formed)


def test_the_spare_taking_the_place_of_a_member_back_with_another_number_of_workers_fetches_its_copies():
    """The same with peer copies on: the spare is told to fetch b's copies from their holder, so b's ranks resume
    from them and every other rank from its own memory."""
    config = JobConfig(min_nodes=2, max_nodes=3, lease_timeout_s=5.0, last_call_s=3.0)
    rz = copies.started({"a": "1", "b": "2", "c": "3"}, config)
    copies.join(rz, "s", 0.5, config, domain="4")
    rz.handle(copies.JOB, PollRequest(v=1, node_id="b", credential="secret-b",
                                      copies=CopiesNote(local_step=10, copied_step=10, holder="10.0.0.3:4000")), 9.5)
    for n in ("a", "c", "s"):
        copies.poll(rz, n, 10.0)
    rz.connection_dropped(copies.JOB, "b", 10.0, heard=True)
    rz.tick(10.0 + DROP_GRACE_S)
    assert rz.jobs[copies.JOB].awaited == ["b"] and rz.jobs[copies.JOB].spares == ["s"]
    rz.handle(copies.JOB, JoinRequest(v=1, node_id="b", addr="10.0.0.2", local_world_size=1, master_port=20000,
                                      config=config, instance="b#2", host="host-b", witness_port=4000,
                                      copy_port=4000, copy_verifiers=True, domain="2"), 12.0, Arrival(secret="b2"))
    r = rz.jobs[copies.JOB].round
    assert r is not None and r.members == ["a", "s", "c"] and rz.jobs[copies.JOB].spares == ["b"], r
    got = rz.view(copies.JOB, "s", 12.5).assignment
    assert got is not None and got.copies_of == "b" and got.copies_at is not None, got


def test_a_job_of_replicas_back_with_another_number_of_workers_is_told_nothing():
    rz = running(["a", "b", "c"], ELASTIC)
    job(rz).progress.alike_step, job(rz).progress.all_alike = 10, True     # DDP: a rank without the step is lent it
    snapshots(rz, "a", 9.0)
    crash_agent(rz, "b", 10.0)
    rz.tick(10.0 + DROP_GRACE_S)
    join(rz, "b", 10.5, ELASTIC, instance="b#2", lws=2)
    assert "ranks move" not in last_event(rz, "round_completed")


def test_a_new_agent_killed_again_as_it_prepares_is_still_awaited():
    """A review: b's agent killed, its next agent killed again a second later while its warm interpreter imported.
    That agent had told no snapshot yet, so its loss did not count as a restart: the job stopped waiting, shrank
    (c took b's ranks), and grew back when b's third agent came: every rank from step 0. Its memory is its
    predecessor's: it is awaited, and b's third agent takes the place back."""
    cfg = msgspec.structs.replace(ELASTIC, exclude_lost_after=2)
    rz = running(["a", "b", "c"], cfg)
    crash_agent(rz, "b", 10.0)
    rz.tick(10.0 + DROP_GRACE_S)
    join(rz, "b", 11.0, cfg, instance="b#2", ready=False)          # preparing
    heard(rz, "ac", 11.5)
    rz.connection_dropped(JOB, "b", 12.0, heard=True)               # killed again
    rz.tick(12.0 + DROP_GRACE_S)
    assert job(rz).round is None and job(rz).awaited == ["b"]
    join(rz, "b", 13.0, cfg, instance="b#3")
    assert members(rz) == ["a", "b", "c"] and "b is back at its place" in last_event(rz, "round_completed")
    assert "excluded" not in [e.kind.value for e in job(rz).events]


FIXED = JobConfig(min_nodes=3, max_nodes=3, max_restarts=3, lease_timeout_s=5.0, last_call_s=3.0)


@pytest.mark.parametrize("back", [False, True])
def test_a_node_joining_a_fixed_size_job_short_of_an_awaited_member_takes_its_place_when_the_wait_ends(back):
    """A review: c's agent killed in a 3:3 job (its memory told a snapshot: awaited), and a new node d joined to
    replace it. Below min_nodes no wait ran, d was benched as a spare, and nothing ever gave it the place: the job
    waited for nodes until its join timeout. d now waits for the round and starts c's wait; c not back within it,
    d takes c's place; c back, it keeps its place and d is spare."""
    rz = running(["a", "b", "c"], FIXED)
    crash_agent(rz, "c", 10.0, copied=10)
    rz.tick(10.0 + DROP_GRACE_S)
    assert job(rz).awaited == ["c"] and job(rz).last_call_deadline is None      # short of nodes: no wait yet
    join(rz, "d", 11.0, FIXED)
    assert job(rz).spares == [] and job(rz).round is None
    assert job(rz).last_call_deadline is not None and job(rz).last_call_deadline <= 10.0 + 2 * window_s(FIXED)
    assert "waiting up to" in job(rz).reason and "for node c to come back" in job(rz).reason, job(rz).reason
    if back:
        join(rz, "c", 12.0, FIXED, instance="c#2")
        assert members(rz) == ["a", "b", "c"] and job(rz).spares == ["d"]
        return
    for t in range(12, 20):
        heard(rz, "abd", float(t))
        rz.tick(float(t))
    assert members(rz) == ["a", "b", "d"] and job(rz).awaited == [] and job(rz).restart_count == 0
    assert "node c not back within" in last_event(rz, "round_completed")


def test_a_node_joining_long_after_a_fixed_size_jobs_member_was_lost_takes_its_place_at_once():
    rz = running(["a", "b", "c"], FIXED)
    crash_agent(rz, "c", 10.0, copied=10)
    rz.tick(10.0 + DROP_GRACE_S)
    for t in range(11, 60, 2):
        heard(rz, "ab", float(t))
        rz.tick(float(t))
    join(rz, "d", 60.0, FIXED)                  # the wait's bound (two windows from c's loss) long past
    rz.tick(60.0)
    assert members(rz) == ["a", "b", "d"] and job(rz).awaited == []


@pytest.mark.parametrize("ready_after", [3.0, None])
def test_a_replacement_still_preparing_at_the_waits_end_is_waited_for_while_it_prepares(ready_after):
    """A review: a 2:3 job's member c lost (awaited), a replacement d joined a second later and was ready 11 s after;
    the job shrank at the wait's end and grew again with d: every rank from step 0. d is waited for as a member
    back and preparing is; never ready, the job goes on without it at that bound."""
    rz = running(["a", "b", "c"], ELASTIC)
    crash_agent(rz, "c", 10.0, copied=10)
    rz.tick(10.0 + DROP_GRACE_S)
    join(rz, "d", 11.0, ELASTIC, ready=False)                 # its warm interpreter imports
    end = job(rz).last_call_deadline
    heard(rz, "ab", 12.0, 14.0, end - 0.1)
    poll(rz, "d", end - 0.1, ready=False)
    rz.tick(end)
    assert job(rz).round is None and "node d, to take the place, still preparing" in job(rz).reason, job(rz).reason
    bound = 10.0 + DROP_GRACE_S + 2 * WINDOW + MAX_PREPARE_S
    assert job(rz).last_call_deadline == pytest.approx(bound)
    if ready_after is not None:
        heard(rz, "ab", end + ready_after)
        poll(rz, "d", end + ready_after, ready=True)
        rz.tick(end + ready_after)
        assert members(rz) == ["a", "b", "d"] and job(rz).restart_count == 0
        assert "d takes c's place" in last_event(rz, "round_completed"), last_event(rz, "round_completed")
        return
    t = end
    while t < bound:
        t += 2.0
        heard(rz, "ab", t)
        poll(rz, "d", t, ready=False)
        rz.tick(t)
    assert members(rz) == ["a", "b"]
