"""A job's training progress as its agents report it (ProgressNote, on the requests they send anyway): steps and
steps per second, the time each restart cost, and the effective training time ratio. Pure; `now` is an argument.

Definitions (docs/operators.md): a restart's cost is the time from the last step before it to the first step
after it, whatever caused it; the ratio is the time since the job's first step less those costs (and the one
under way), over the time since the first step. With node_agent.snapshot the steps redone after each restore
are counted too: the steps the job had reached, less the step it resumed from.
"""
from __future__ import annotations

import statistics

import msgspec

from protocol.notes import ProgressNote
from protocol.restarts import RestartAnatomy

MAX_COSTS = 32          # restarts kept one by one (the total counts them all)
MAX_RATE_POINTS = 240   # points of the steps-per-second picture; when full, every other one goes
RATE_EVERY_S = 10.0     # the picture's first spacing (it doubles each time the points are thinned)


class RestartCost(msgspec.Struct, kw_only=True, omit_defaults=True):
    round_id: int            # the round that stepped again
    cause: str               # what ended the round before it (a RoundCause value)
    last_step_at: float      # before the restart
    stepped_at: float = 0.0  # after it (0: not yet)
    redone: int = -1         # steps done again after a restore (-1: unknown)
    anatomy: RestartAnatomy | None = None   # where its time went on the node that stepped again last
    anatomy_node: str = ""

    @property
    def cost_s(self) -> float:
        return max(0.0, self.stepped_at - self.last_step_at) if self.stepped_at else 0.0


class JobProgress(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Saved with the job: what its ratio and costs are computed from."""
    first_step_at: float = 0.0
    last_step_at: float = 0.0
    steps_before: int = 0      # steps of the rounds before this one
    round_id: int = -1
    round_first_at: float = 0.0
    round_last_at: float = 0.0
    round_steps: int = 0
    round_resumed: int = -1    # the step the round's workers resumed from (node_agent.snapshot; -1: unknown)
    reached: int = -1          # the step the job had reached before this round (-1: unknown)
    costs: list[RestartCost] = msgspec.field(default_factory=list)
    lost_s: float = 0.0        # the cost of every restart done, those no longer in `costs` too
    restarts: int = 0
    redone: int = 0
    rate_points: list[tuple[float, float]] = msgspec.field(default_factory=list)
    rate_every_s: float = RATE_EVERY_S
    rates: dict[str, float] = msgspec.field(default_factory=dict)    # each node's steps per second lately
    slow: list[str] = msgspec.field(default_factory=list)            # nodes named slow now (slow.py)
    alike_step: int = -1       # the newest snapshot step every replica held alike (divergence.py; -1: none)
    all_alike: bool = False    # ... and the replicas were every rank (DDP), not each shard's (HSDP): ranks_alike

    @property
    def steps(self) -> int:
        return self.steps_before + self.round_steps

    @property
    def pending(self) -> RestartCost | None:
        """The restart under way: the job stepped, then a new round began and has not stepped yet."""
        return self.costs[-1] if self.costs and not self.costs[-1].stepped_at else None

    def steps_per_s(self) -> float:
        return statistics.median(self.rates.values()) if self.rates else 0.0

    def ratio(self, now: float, running: bool) -> float | None:
        """The effective training time ratio (None: the job has not stepped)."""
        if not self.first_step_at:
            return None
        end = now if running else max(self.last_step_at, self.first_step_at)
        span = end - self.first_step_at
        if span <= 0:
            return 1.0
        pending = self.pending
        lost = self.lost_s + (max(0.0, end - pending.last_step_at) if pending is not None and running else 0.0)
        return max(0.0, min(1.0, (span - lost) / span))


def round_ended(p: JobProgress, cause: str) -> None:
    """The running round ended (a new one forms, or the job waits for nodes): if it stepped, a restart begins,
    costing from its last step until the next round's first (round_id -1 until that round forms)."""
    if p.round_last_at:
        p.costs.append(RestartCost(round_id=-1, cause=cause, last_step_at=p.round_last_at))
        del p.costs[:-MAX_COSTS]
        base = p.round_resumed if p.round_resumed >= 0 else (0 if p.steps_before == 0 and p.reached < 0 else -1)
        p.reached = base + p.round_steps if base >= 0 else -1
    p.steps_before += p.round_steps
    p.round_id, p.round_first_at, p.round_last_at, p.round_steps, p.round_resumed = -1, 0.0, 0.0, 0, -1
    p.rates.clear()


def round_formed(p: JobProgress, round_id: int, cause: str) -> None:
    """A new round: the one before ends (if it had not), and the restart under way is this round's to end."""
    if p.round_id != -1 or p.round_last_at:
        round_ended(p, cause)
    p.round_id = round_id
    pending = p.pending
    if pending is not None and pending.round_id == -1:
        pending.round_id = round_id


def note(p: JobProgress, node_id: str, n: ProgressNote, round_id: int, now: float) -> RestartCost | None:
    """One node's note on round `round_id` (the running one; notes on others are stale: dropped). Returns the
    restart this note saw end (the round's first step), if it did."""
    if n.round_id != round_id:
        return None
    if p.round_id != round_id:      # a job saved before it kept progress: counted from here
        round_formed(p, round_id, "")
    if n.resumed_step >= 0:
        p.round_resumed = max(p.round_resumed, n.resumed_step)
    if n.window_s > 0:
        p.rates[node_id] = n.window_steps / n.window_s
    _anatomy(p, node_id, n.anatomy, round_id)
    if not n.steps:
        return None
    p.round_steps = max(p.round_steps, n.steps)
    p.round_first_at = min(p.round_first_at or n.first_step_at, n.first_step_at)
    p.round_last_at = max(p.round_last_at, n.last_step_at)
    p.first_step_at = p.first_step_at or p.round_first_at
    p.last_step_at = max(p.last_step_at, p.round_last_at)
    pending = p.pending
    if pending is not None:
        pending.stepped_at = p.round_first_at
        if p.reached >= 0 and p.round_resumed >= 0:
            pending.redone = max(0, p.reached - p.round_resumed)
            p.redone += pending.redone
        p.lost_s += pending.cost_s
        p.restarts += 1
    _rate_point(p, now)
    return pending


def _rate_point(p: JobProgress, now: float) -> None:
    if p.rate_points and now - p.rate_points[-1][0] < p.rate_every_s:
        return
    p.rate_points.append((round(now, 3), round(p.steps_per_s(), 4)))
    if len(p.rate_points) > MAX_RATE_POINTS:
        p.rate_points = p.rate_points[::2]
        p.rate_every_s *= 2


def _anatomy(p: JobProgress, node_id: str, seen: RestartAnatomy | None, round_id: int) -> None:
    """A node's restart phases: the restart this round ended keeps those of the node whose took longest (the
    one the job waited for)."""
    cost = p.costs[-1] if p.costs else None
    if seen is None or cost is None or cost.round_id != round_id:
        return
    if cost.anatomy is None or seen.total > cost.anatomy.total or cost.anatomy_node == node_id:
        cost.anatomy, cost.anatomy_node = seen, node_id
