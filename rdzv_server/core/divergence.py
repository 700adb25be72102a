"""Replicas that diverge (silent data corruption): ranks that hold the same tensors (a DDP job's parameters, as
`protect` knows them) must hold the same bytes at the same step. Each snapshot's digest of those tensors comes
on the agents' progress notes (ProgressNote.digests); once every rank of the round has told its digest of a
step, the step is judged (pure; `now` is an argument):
- all alike: the newest agreed step;
- one value held by more than half of the ranks: the others diverged. The round fails (a restart, reason
  `diverged`, the first odd rank the root cause), its node is a suspect (suspects.py: a ready spare takes its
  place), and every node drops its snapshots newer than the newest agreed step (Assignment.resume_at_most),
  so the job resumes from bytes every replica held (none judged alike yet, as after a server restart: those
  before the diverged step, rather than none);
- no majority (two ranks, or an even split): nobody is named; the job still resumes from the agreed step.
The digests are kept in memory for the running round only (a new server judges the steps it sees)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from protocol.messages import RankDigest

KEEP_STEPS = 8          # steps whose digests are held while some rank has not told its own


@dataclass
class Digests:
    round_id: int = -1
    world: int = 0
    by_step: dict[int, dict[int, int]] = field(default_factory=dict)   # step -> rank -> digest
    agreed: int = -1                   # the newest step every rank held alike (-1: none judged yet)


@dataclass(frozen=True)
class Diverged:
    step: int
    odd: list[int]                     # the ranks off the majority ([]: no majority)
    agreed: int                        # the newest step all held alike (-1: none)
    ranks: int                         # how many ranks told their digest of `step`


def note(d: Digests, round_id: int, world: int, told: list[RankDigest]) -> Diverged | None:
    """Digests told for round `round_id` of `world` ranks; the first step judged diverged, or None."""
    if d.round_id != round_id:
        d.round_id, d.world, d.by_step = round_id, world, {}
    for t in told:
        if t.rank < world and t.step > d.agreed:
            d.by_step.setdefault(t.step, {})[t.rank] = t.digest
    for step in sorted(d.by_step)[:-KEEP_STEPS]:
        del d.by_step[step]
    for step in sorted(s for s, held in d.by_step.items() if len(held) == world):
        held = d.by_step.pop(step)
        (value, count), *_ = Counter(held.values()).most_common(1)
        if count == world:
            d.agreed = max(d.agreed, step)
            continue
        odd = sorted(r for r, v in held.items() if v != value) if 2 * count > world else []
        d.by_step.clear()
        return Diverged(step=step, odd=odd, agreed=d.agreed, ranks=world)
    return None


def line(v: Diverged) -> str:
    back = f"the job resumes from step {v.agreed}, the newest all held alike" if v.agreed >= 0 else \
        ("no step was seen alike yet (a new round of a new server): the job resumes from a snapshot before step "
         f"{v.step}")
    if v.odd:
        return (f"rank(s) {', '.join(map(str, v.odd))} hold other parameters than the other {v.ranks - len(v.odd)} "
                f"replicas at step {v.step} (silent data corruption?); {back}")
    return f"the {v.ranks} replicas hold different parameters at step {v.step}, with no majority; {back}"
