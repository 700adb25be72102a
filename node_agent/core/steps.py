"""This node's workers' steps in the round they run, from what their probes write (pure: the shell
reads the records and /proc, `now` is an argument). It says when a rank has stalled, past a threshold taken from
the job's own step times, and sums the round up for the server (`ProgressNote`, on the next request).

A rank is watched once it has stepped: a job with no progress signal (no optimizer step, no `beat()`) is never
stalled here. The threshold is max(STALL_FLOOR_S, STALL_STEPS x the median recent step), so a certain hang is
decided within max(10 s, 3 steps) plus the restart; what a rank is doing then decides (stalls.py).
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from node_agent.core import anatomy
from node_agent.core.stalls import ProcSample
from protocol.notes import PACE_MAX_WINDOW_S, PACE_MIN_STEPS, ProgressNote, RankDigest
from protocol.restarts import RestartAnatomy

STALL_FLOOR_S = 5.0
STALL_STEPS = 3.0
REPORT_GRID_S = 5.0      # a stall's reports are re-sent at wall-clock multiples of this x 2^k (report_period)
RECENT_STEPS = 64        # step intervals the median is taken over
STEP_WEIGHT = 16         # entries one look adds at most (one per step it saw)


def report_period(threshold_s: float) -> float:
    """How often a stall's report is sent again: the smallest REPORT_GRID_S x 2^k at or above the threshold."""
    period = REPORT_GRID_S
    while period < threshold_s:
        period *= 2
    return period


def next_report_at(wall_now: float, threshold_s: float) -> float:
    """When to send a stall's report again: the first multiple of its period (unix time) at least half a period
    away. The server decides only from reports of one moment, so every node of a job re-sends on the same
    wall-clock ticks, whatever its own threshold (periods of 5 x 2^k s share the longer one's ticks), rather than
    each on its own phase, which two nodes may never share."""
    period = report_period(threshold_s)
    return (math.floor((wall_now + period / 2) / period) + 1) * period


@dataclass(frozen=True)
class ProbeRecord:
    """A worker's record as its probe last wrote it (node_agent/training/probe.py); times are unix times."""
    steps: int
    first_at: float
    last_at: float
    pid: int
    flags: int
    main_thread: int
    resumed_step: int = -1
    milestones: dict[str, float] = field(default_factory=dict)   # probe.MILESTONES noted (unix times)
    digests: tuple[tuple[int, int], ...] = ()   # (step, digest) of its newest snapshots' replicated tensors
    pace: tuple[int, float, float] = (0, 0.0, 0.0)   # steps counted for the pace, their time, the time waited
    waits_measured: bool = False                    # the probe timed a wait on the others (backward, collective)
    on_device: bool = False      # its collectives run on an accelerator (NCCL): the host does not wait in them
    held_step: int = -1          # the snapshot it waits after, as the agent asked (-1: none)
    replica_group: int = 0       # the ranks its digests are compared with (those of the same group)


def failed_at_start(record: ProbeRecord | None) -> bool:
    """Its probe saw the worker start and neither begin torch.distributed's process group nor take a step: a failure
    then is its own (WorkerFailure.before_group), where one that stepped (rpc, its own sockets) may be a peer's
    victim. The one rule of node-agent's reports and the torchrun plugin's."""
    return record is not None and bool(record.milestones.get("started")) and \
        not record.milestones.get("group_begun") and record.steps == 0


@dataclass
class RankSteps:
    record: ProbeRecord | None = None
    proc: ProcSample | None = None           # the latest look
    window_proc: ProcSample | None = None    # the look the demand window started at
    window_pace: tuple[int, float, float] | None = None   # the record's pace when the window started
    exited: int | None = None                # its exit code, once it ended
    looked_at: float = 0.0                   # the unix time of the latest look that read its record


@dataclass
class RoundSteps:
    """One round's local ranks: their records and /proc looks, their recent step intervals."""
    round_id: int
    ranks: dict[int, RankSteps] = field(default_factory=dict)
    intervals: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    window_started: float | None = None      # monotonic time of the window's first look
    window_steps_from: int = 0
    # A restart's node side (anatomy.py): the node's last step before this round and when its workers were all
    # gone (None: this node did not step before, so this round is no restart of its), when this round's spawned.
    before: tuple[float, float] | None = None
    spawned_at: float = 0.0
    global_ranks: dict[int, int] = field(default_factory=dict)

    def observe(self, local_rank: int, record: ProbeRecord | None, proc: ProcSample | None, now: float,
                wall: float = 0.0) -> None:
        """One look at a rank at `now` (monotonic) and `wall` (unix time; 0: not known), `record` None: no valid
        record yet; `proc` None: the process is gone."""
        rank = self.ranks.setdefault(local_rank, RankSteps())
        old = rank.record
        if record is not None:
            if old is not None and record.steps > old.steps and old.steps > 0:
                # The steps this look saw took from the last one before it, or from the look before if that
                # came later (a pause, such as an evaluation, ended between the looks: it is no step time),
                # to the last one; one entry per step (up to a bound), so a look over a few steps after a pause
                # weighs no more than those steps.
                steps = record.steps - old.steps
                gap = (record.last_at - max(old.last_at, rank.looked_at)) / steps
                if gap > 0:
                    self.intervals.extend([gap] * min(steps, STEP_WEIGHT))
            rank.record = record
            rank.looked_at = wall
            if rank.window_pace is None:
                rank.window_pace = record.pace
        rank.proc = proc
        if rank.window_proc is None:
            rank.window_proc = proc
        if self.window_started is None:
            self.window_started = now

    def exited(self, local_rank: int, code: int) -> None:
        self.ranks.setdefault(local_rank, RankSteps()).exited = code

    def all_stepped(self, count: int) -> bool:
        """Whether `count` local ranks have each done a step (so each is past its start: its snapshot agreement)."""
        return sum(1 for r in self.ranks.values() if r.record is not None and r.record.steps > 0) >= count

    @property
    def steps(self) -> int:
        return max((r.record.steps for r in self.ranks.values() if r.record is not None), default=0)

    def step_s(self) -> float:
        """The median of the recent step intervals (0: fewer than two steps seen)."""
        return statistics.median(self.intervals) if self.intervals else 0.0

    def threshold_s(self) -> float:
        return max(STALL_FLOOR_S, STALL_STEPS * self.step_s())

    def stalled(self, wall_now: float) -> list[int]:
        """Local ranks still running that stepped, but not for the threshold: the stalled ones."""
        limit = self.threshold_s()
        return sorted(lr for lr, r in self.ranks.items()
                      if r.exited is None and r.record is not None and r.record.steps > 0
                      and wall_now - r.record.last_at >= limit)

    def note(self, now: float) -> ProgressNote:
        """The round so far, and the window since the last note (which this one closes)."""
        records = [r.record for r in self.ranks.values() if r.record is not None]
        stepped = [r for r in records if r.steps > 0]
        window_s = max(0.0, now - self.window_started) if self.window_started is not None else 0.0
        steps = self.steps
        window_steps = max(0, steps - self.window_steps_from)
        closes = window_steps >= PACE_MIN_STEPS or window_s >= PACE_MAX_WINDOW_S
        note = ProgressNote(
            round_id=self.round_id, probes=len(records), steps=steps,
            first_step_at=min((r.first_at for r in stepped), default=0.0),
            last_step_at=max((r.last_at for r in stepped), default=0.0),
            step_s=round(self.step_s(), 6), window_s=round(window_s, 3) if closes else 0.0,
            window_steps=window_steps if closes else 0, demand=round(self._demand(window_s), 3) if closes else 0.0,
            waited=round(self._waited(), 3) if closes else -1.0,
            resumed_step=max((r.resumed_step for r in records), default=-1), anatomy=self.anatomy(),
            held_step=self.held_step(),
            on_device=any(r.record.on_device for r in self.ranks.values() if r.record is not None),
            digests=[RankDigest(rank=self.global_ranks.get(lr, lr), step=step, digest=value,
                                group=r.record.replica_group)
                     for lr, r in sorted(self.ranks.items()) if r.record is not None
                     for step, value in r.record.digests])
        if closes:
            self.window_started, self.window_steps_from = now, steps
            for r in self.ranks.values():
                r.window_proc = r.proc
                r.window_pace = r.record.pace if r.record is not None else None
        return note

    def anatomy(self) -> RestartAnatomy | None:
        """This round's restart on this node, once every rank has stepped (None: not yet, or no restart)."""
        if self.before is None or not self.spawned_at or not self.ranks:
            return None
        node = anatomy.RestartStart(self.before[0], self.before[1], self.spawned_at)
        workers = [anatomy.RankStart(self.global_ranks.get(lr, lr), r.record.milestones.get("started", 0.0),
                                     r.record.first_at if r.record.steps else 0.0,
                                     {p: (r.record.milestones.get(f"{p}_begun", 0.0),
                                          r.record.milestones.get(f"{p}_done", 0.0)) for p in anatomy.TIMED})
                   if r.record is not None else anatomy.RankStart(lr, 0.0, 0.0, {})
                   for lr, r in self.ranks.items()]
        return anatomy.of_node(node, workers)

    def newest_digest(self) -> int:
        """The newest step any rank told a digest of (-1: none): a new one is worth a note at once."""
        return max((r.record.digests[-1][0] for r in self.ranks.values() if r.record is not None and r.record.digests),
                   default=-1)

    def resumed_ranks(self) -> int:
        """How many ranks said the step they resumed from (snapshot.agreed_step, protect): news for the server."""
        return sum(1 for r in self.ranks.values() if r.record is not None and r.record.resumed_step >= 0)

    def held_step(self) -> int:
        """The newest snapshot step a rank waits after (-1: none): news for the server at once, as a digest is."""
        return max((r.record.held_step for r in self.ranks.values() if r.record is not None), default=-1)

    def last_step_at(self) -> float:
        return max((r.record.last_at for r in self.ranks.values() if r.record is not None and r.record.steps),
                   default=0.0)

    def _demand(self, window_s: float) -> float:
        """The mean over running ranks of the share of the window their main thread ran or waited to run."""
        shares = []
        for r in self.ranks.values():
            a, b = r.window_proc, r.proc
            if a is None or b is None or window_s <= 0 or r.exited is not None:
                continue
            used = (b.cpu_s - a.cpu_s) + (b.run_delay_s - a.run_delay_s)
            shares.append(min(1.0, max(0.0, used / window_s)))
        return sum(shares) / len(shares) if shares else 0.0

    def _waited(self) -> float:
        """Of the time of the window's counted steps (probe.py: outliers left out), the share its running ranks
        waited on the others (-1: not measured: no rank timed a wait, or fewer than PACE_MIN_STEPS counted)."""
        steps, took, waited, measured = 0, 0.0, 0.0, False
        for r in self.ranks.values():
            if r.record is None or r.window_pace is None or r.exited is not None:
                continue
            measured |= r.record.waits_measured
            (s0, t0, w0), (s1, t1, w1) = r.window_pace, r.record.pace
            if s1 >= s0:        # (fewer: another process's record)
                steps, took, waited = steps + s1 - s0, took + t1 - t0, waited + w1 - w0
        if not measured or steps < PACE_MIN_STEPS or took <= 0:
            return -1.0
        return min(1.0, max(0.0, waited / took))
