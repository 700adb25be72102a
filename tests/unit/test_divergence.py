"""Replicas that diverge (rdzv_server/core/divergence.py): a step is judged once every rank told its digest of
it; all alike moves the agreed step, a minority is named (the round fails for its node, the next round resumes
at most from the agreed step), no majority names nobody. Through the real core with agents' progress notes."""
from __future__ import annotations

import pytest

from protocol.messages import JobConfig, JoinRequest, NodeState, PollRequest
from protocol.notes import ProgressNote, RankDigest
from rdzv_ctl import tables as ctl
from rdzv_server.core import divergence
from rdzv_server.core.rendezvous import Rendezvous
from rdzv_server.core.requests import Arrival
from rdzv_server.web import views
from rdzv_server.web.page import render as page

T = 1_700_000_000.0
CFG = JobConfig(min_nodes=3, max_nodes=3, max_restarts=5, last_call_s=0.0, lease_timeout_s=10_000.0)


def told(step: int, values: dict[int, int]) -> list[RankDigest]:
    return [RankDigest(rank=r, step=step, digest=v) for r, v in values.items()]


def test_a_step_is_judged_when_every_rank_told_it() -> None:
    d = divergence.Digests()
    assert divergence.note(d, 1, 3, told(5, {0: 7, 1: 7})) is None      # rank 2 has not told step 5 yet
    assert divergence.note(d, 1, 3, told(5, {2: 7})) is None and d.agreed == 5
    verdict = divergence.note(d, 1, 3, told(10, {0: 7, 1: 9, 2: 7}))
    assert verdict == divergence.Diverged(step=10, odd=[1], agreed=5, ranks=3)
    assert "rank(s) 1 hold other parameters than the other 2 replicas at step 10" in divergence.line(verdict)
    assert divergence.note(d, 2, 3, told(10, {0: 1})) is None and d.by_step == {10: {0: (0, 1)}}   # a new round


def test_two_ranks_or_an_even_split_name_nobody() -> None:
    assert divergence.note(divergence.Digests(), 1, 2, told(5, {0: 1, 1: 2})) == \
        divergence.Diverged(step=5, odd=[], agreed=-1, ranks=2)
    verdict = divergence.note(divergence.Digests(), 1, 4, told(5, {0: 1, 1: 1, 2: 2, 3: 2}))
    assert verdict is not None and verdict.odd == []
    assert "with no majority to name one; no step was seen alike yet (a new round of a new server): the job " \
           "resumes from a snapshot before step 5" in divergence.line(verdict)


def test_hsdp_replicas_are_compared_within_their_shards_group_only() -> None:
    """6 ranks, 2 shards of 3 replicas: shard 0 on ranks 0, 2, 4 and shard 1 on 1, 3, 5 (their digests differ
    between shards: other tensors); rank 3 off its shard's majority. With 2 replicas a shard names nobody."""
    def hsdp(step: int, values: dict[int, int]) -> list[RankDigest]:
        return [RankDigest(rank=r, step=step, digest=v, group=r % 2) for r, v in values.items()]
    d = divergence.Digests()
    assert divergence.note(d, 1, 6, hsdp(5, {0: 10, 1: 11, 2: 10, 3: 11, 4: 10, 5: 11})) is None and d.agreed == 5
    verdict = divergence.note(d, 1, 6, hsdp(10, {0: 10, 1: 11, 2: 10, 3: 99, 4: 10, 5: 11}))
    assert verdict == divergence.Diverged(step=10, odd=[3], agreed=5, ranks=6, groups=2)
    assert "rank(s) 3 hold other parameters than the other replicas of their shard at step 10" in \
        divergence.line(verdict)
    pairs = divergence.note(divergence.Digests(), 1, 4, [RankDigest(rank=r, step=5, digest=v, group=r % 2)
                                                       for r, v in {0: 1, 1: 2, 2: 1, 3: 3}.items()])
    assert pairs is not None and pairs.odd == [] and "replicas of a shard (2 shards)" in divergence.line(pairs)


def join(rz: Rendezvous, node: str, now: float) -> None:
    rz.handle("j", JoinRequest(v=1, node_id=node, addr="10.0.0.1", host=f"host-{node}", local_world_size=2,
                               master_port=29500, config=CFG, instance=f"{node}#1"), now,
              Arrival(secret=f"secret-{node}"))


def poll(rz: Rendezvous, node: str, now: float, digests: list[RankDigest] | None = None):
    job = rz.jobs["j"]
    note = ProgressNote(round_id=job.round.round_id, digests=digests or []) if digests is not None else None
    return rz.handle("j", PollRequest(v=1, node_id=node, credential=f"secret-{node}", known_round=-1, wait_s=0.0,
                                      progress=note), now)


def test_a_rank_whose_parameters_differ_fails_the_round_and_the_next_resumes_from_the_agreed_step() -> None:
    rz = Rendezvous()
    for node in ("a", "b", "c"):
        join(rz, node, T)
    join(rz, "s", T + 1)                                           # a spare
    offsets = {n: poll(rz, n, T + 2).assignment.rank_offset for n in ("a", "b", "c")}
    for step, odd in ((5, None), (10, "b")):
        for n, at in offsets.items():
            poll(rz, n, T + step, told(step, {at: 1 if n != odd else 2, at + 1: 1}))
    job = rz.jobs["j"]
    events = [(e.kind.value, e.message) for e in job.events if e.kind in ("replicas_diverged", "node_suspect")]
    assert events[0] == ("replicas_diverged", f"rank(s) {offsets['b']} hold other parameters than the other 5 "
                         f"replicas at step 10 (silent data corruption?); the job resumes from step 5, the newest "
                         f"all held alike")
    assert events[1][0] == "node_suspect" and "its replicated tensors diverged" in events[1][1]
    assert job.restart_count == 1 and job.nodes["b"].state == NodeState.EXCLUDED and "s" in job.round.members
    assert job.root_cause is not None and job.root_cause.reason == "diverged"
    assert {poll(rz, n, T + 20).assignment.resume_at_most for n in job.round.members} == {5}
    assert job.resume_at_most == -1                                # told to that round only


def test_the_newest_step_all_held_alike_is_shown() -> None:
    rz = Rendezvous()
    for node in ("a", "b", "c"):
        join(rz, node, T)
    offsets = {n: poll(rz, n, T + 2).assignment.rank_offset for n in ("a", "b", "c")}
    job = rz.jobs["j"]
    for n, at in offsets.items():
        note = ProgressNote(round_id=job.round.round_id, steps=5, first_step_at=T + 3, last_step_at=T + 5,
                            digests=told(5, {at: 7, at + 1: 7}))
        rz.handle("j", PollRequest(v=1, node_id=n, credential=f"secret-{n}", known_round=-1, wait_s=0.0,
                                   progress=note), T + 6)
    detail = views.job_detail(job, T + 7)
    assert detail.progress.alike_step == 5
    assert "replicas   alike at step 5 (the newest snapshot compared)" in ctl.format_job(detail).splitlines()
    assert 'data-alike="1"' in (page.job_page(rz, "j", T + 7) or "")


def test_a_node_that_runs_more_ranks_does_not_outvote_the_others() -> None:
    """A review: node h ran 5 ranks (its own --nproc) and sent one made-up digest for all of them; a and b, 2 honest
    ranks each, were the minority: b was named a suspect and excluded, and on a tie the job failed. Each node is one
    voice: h is the one whose ranks differ."""
    cfg = JobConfig(min_nodes=3, max_nodes=3, max_restarts=5, last_call_s=0.0, lease_timeout_s=10_000.0)
    rz = Rendezvous()
    for node, workers in (("a", 2), ("b", 2), ("h", 5)):
        rz.handle("j", JoinRequest(v=1, node_id=node, addr="10.0.0.1", host=f"host-{node}", local_world_size=workers,
                                   master_port=29500, config=cfg, instance=f"{node}#1"), T,
                  Arrival(secret=f"secret-{node}"))
    spans = {n: (a.rank_offset, a.local_world_size) for n in ("a", "b", "h")
             if (a := poll(rz, n, T + 2).assignment) is not None}
    for n, (at, size) in spans.items():
        poll(rz, n, T + 5, told(5, {at + i: 666 if n == "h" else 1 for i in range(size)}))
    event = next(e.message for e in rz.jobs["j"].events if e.kind == "replicas_diverged")
    h_ranks = ", ".join(str(spans["h"][0] + i) for i in range(5))
    assert event.startswith(f"rank(s) {h_ranks} hold other parameters"), event
    assert rz.jobs["j"].nodes["b"].state != NodeState.EXCLUDED


@pytest.mark.parametrize("shards", [1, 2])
def test_a_round_after_the_replicas_agreed_tells_its_nodes_their_ranks_are_alike(shards: int) -> None:
    """A review (2 gloo nodes, DDP): the survivor that moved into a restarting node's place removed its snapshots (the
    only ones left) as another rank's shards: every rank from step 0. Once the digests agreed, a round says its ranks
    are replicas (Assignment.ranks_alike), and a node whose ranks move keeps them (node_agent/workers/memory.py).
    Not HSDP's (replicas within each shard only): a moved rank would load another shard."""
    from protocol.messages import LeaveRequest
    rz = Rendezvous()
    for node in ("a", "b", "c"):
        join(rz, node, T)
    offsets = {n: poll(rz, n, T + 2).assignment.rank_offset for n in ("a", "b", "c")}
    assert not any(poll(rz, n, T + 3).assignment.ranks_alike for n in offsets)      # nothing compared yet
    for n, at in offsets.items():
        poll(rz, n, T + 5, [RankDigest(rank=r, step=5, digest=7 + r % shards, group=r % shards) for r in (at, at + 1)])
    rz.jobs["j"].config = JobConfig(min_nodes=2, max_nodes=3, max_restarts=5, last_call_s=0.0, lease_timeout_s=1e4)
    rz.handle("j", LeaveRequest(v=1, node_id="a", credential="secret-a"), T + 6)
    job = rz.jobs["j"]
    assert job.round is not None and sorted(job.round.members) == ["b", "c"] and job.progress.alike_step == 5
    assert {poll(rz, n, T + 7).assignment.ranks_alike for n in job.round.members} == {shards == 1}


def test_replicas_that_are_a_shards_only_since_are_no_longer_told_alike() -> None:
    """The newest judgement says whether the ranks are replicas, not any before it: an HSDP job whose shard dim was
    1 (every rank a whole replica: one group) and then 2 (its mesh grew with the job, or a node's workers) holds
    shards. Told ranks_alike still, a node whose ranks moved kept another rank's shard, of the same shape, and its
    rank loaded it (a review: the flag, once set, stayed for the job's life)."""
    from protocol.messages import LeaveRequest
    rz = Rendezvous()
    for node in ("a", "b", "c"):
        join(rz, node, T)
    offsets = {n: poll(rz, n, T + 2).assignment.rank_offset for n in ("a", "b", "c")}
    for n, at in offsets.items():           # step 5: one group, every rank alike
        poll(rz, n, T + 5, [RankDigest(rank=r, step=5, digest=7, group=0) for r in (at, at + 1)])
    assert rz.jobs["j"].progress.all_alike
    for n, at in offsets.items():           # step 10: two shards, each alike within itself
        poll(rz, n, T + 6, [RankDigest(rank=r, step=10, digest=7 + r % 2, group=r % 2) for r in (at, at + 1)])
    rz.jobs["j"].config = JobConfig(min_nodes=2, max_nodes=3, max_restarts=5, last_call_s=0.0, lease_timeout_s=1e4)
    rz.handle("j", LeaveRequest(v=1, node_id="a", credential="secret-a"), T + 7)
    job = rz.jobs["j"]
    assert job.round is not None and sorted(job.round.members) == ["b", "c"] and job.progress.alike_step == 10
    assert not job.progress.all_alike
    assert not any(poll(rz, n, T + 8).assignment.ranks_alike for n in job.round.members)
