"""Replicas that diverge (silent data corruption): ranks that hold the same tensors (a DDP job's parameters on
every rank, an HSDP job's on the ranks of one shard: each digest's `group`, as `protect` knows them) must hold
the same bytes at the same step. Each snapshot's digest of those tensors comes on the agents' progress notes
(ProgressNote.digests); once every rank of the round has told its digest of a step, the step is judged, each
group on its own (pure; `now` is an argument):
- all alike in every group: the newest agreed step;
- in a group, one value held by more than half of its nodes (each node one voice, whatever ranks it runs: a review
  had a node that ran 5 ranks and sent one made-up digest outvote two honest nodes of 2 ranks each and get one of
  them excluded): the others diverged. The round fails (a restart, reason
  `diverged`, the first odd rank the root cause), its node is a suspect (suspects.py: a ready spare takes its
  place), and every node drops its snapshots newer than the newest agreed step (Assignment.resume_at_most),
  so the job resumes from bytes every replica held (none judged alike yet, as after a server restart: those
  before the diverged step, rather than none);
- no majority (two replicas, or an even split): nobody is named; the job still resumes from the agreed step.
The digests are kept in memory for the running round only (a new server judges the steps it sees)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from protocol.notes import RankDigest

KEEP_STEPS = 8          # steps whose digests are held while some rank has not told its own


@dataclass
class Digests:
    round_id: int = -1
    world: int = 0
    by_step: dict[int, dict[int, tuple[int, int]]] = field(default_factory=dict)   # step -> rank -> (group, digest)
    agreed: int = -1                   # the newest step every rank held alike (-1: none judged yet)
    voters: dict[int, str] = field(default_factory=dict)     # rank -> the node that told it (its voice)
    groups: int = 0                    # the groups of replicas at `agreed` (1: every rank alike, DDP; HSDP: shards)


@dataclass(frozen=True)
class Diverged:
    step: int
    odd: list[int]                     # the ranks off their group's majority ([]: no majority)
    agreed: int                        # the newest step all held alike (-1: none)
    ranks: int                         # how many ranks told their digest of `step`
    groups: int = 1                    # in how many groups of replicas


def note(d: Digests, round_id: int, world: int, told: list[RankDigest], voter: str = "") -> Diverged | None:
    """Digests told for round `round_id` of `world` ranks by node `voter` (its own ranks; "": each rank its own
    voice); the first step judged diverged, or None."""
    if d.round_id != round_id:
        d.round_id, d.world, d.by_step, d.voters = round_id, world, {}, {}
    for t in told:
        if t.rank < world and t.step > d.agreed:
            d.by_step.setdefault(t.step, {})[t.rank] = (t.group, t.digest)
            if voter:
                d.voters[t.rank] = voter
    for step in sorted(d.by_step)[:-KEEP_STEPS]:
        del d.by_step[step]
    for step in sorted(s for s, held in d.by_step.items() if len(held) == world):
        groups: dict[int, dict[int, int]] = {}
        for rank, (group, value) in d.by_step.pop(step).items():
            groups.setdefault(group, {})[rank] = value
        odd, alike = [], True
        for held in groups.values():
            alike = alike and len(set(held.values())) == 1
            voices = {(d.voters.get(r, f"rank {r}"), v) for r, v in held.items()}     # a node once per value
            (value, count), *_ = Counter(v for _, v in voices).most_common(1)
            if 2 * count > len({who for who, _ in voices}):
                odd += [r for r, v in held.items() if v != value]
        if alike:
            d.agreed, d.groups = max(d.agreed, step), len(groups)
            continue
        d.by_step.clear()
        return Diverged(step=step, odd=sorted(odd), agreed=d.agreed, ranks=world, groups=len(groups))
    return None


def line(v: Diverged) -> str:
    back = f"the job resumes from step {v.agreed}, the newest all held alike" if v.agreed >= 0 else \
        ("no step was seen alike yet (a new round of a new server): the job resumes from a snapshot before step "
         f"{v.step}")
    others = f"the other {v.ranks - len(v.odd)} replicas" if v.groups == 1 else "the other replicas of their shard"
    if v.odd:
        return (f"rank(s) {', '.join(map(str, v.odd))} hold other parameters than {others} at step {v.step} (silent "
                f"data corruption?); {back}")
    replicas = f"the {v.ranks} replicas" if v.groups == 1 else f"replicas of a shard ({v.groups} shards)"
    return f"{replicas} hold different parameters at step {v.step}, with no majority to name one; {back}"
