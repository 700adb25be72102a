"""One round's watch on its workers' steps: every LOOK_S it reads each worker's record and /proc, so the next
request to the server carries the round's progress (`note`); with hang detection on, a rank that stalls is
examined (its stacks at EXAMINE_DUMPS looks EXAMINE_GAP_S apart, its CPU, I/O and GPU meanwhile) and the
evidence goes to the server as a fact for the agent's loop, again on shared wall-clock ticks while the stall
lasts (next_report_at).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import node_agent.training.probe as probe
from node_agent.core.facts import NoteDue, Put, RanksStalled
from node_agent.core.stalls import call_of, classify, main_stack, stack_text
from node_agent.core.steps import ProbeRecord, RankSteps, RoundSteps, next_report_at
from node_agent.workers.failures import keep_tail
from node_agent.workers.probes import BadRecord, ProbeFiles, RecordReader, read_proc, take_stacks
from protocol.bounds import MAX_DURATION_S, MAX_ROUND, MAX_SHORT_TEXT, MAX_TRACEBACK
from protocol.notes import ProgressNote
from protocol.stalls import RankSeen, RankState

LOOK_S = 0.5
# Stacks taken this many times, this far apart: a rank that only passes between phases (a checkpoint ending, a
# collective entered a moment before its peers) moves within them; a culprit, or a rank that waits, does not.
EXAMINE_DUMPS = 3
EXAMINE_GAP_S = 0.75
STACKS_BUDGET = 256 * 1024      # the stacks of one report, shared by its ranks (the request stays small)


@dataclass
class _Rank:
    local_rank: int
    rank: int
    files: ProbeFiles
    reader: RecordReader | None = None
    ignored: bool = False        # its record did not parse: read no more this round


class StepWatch:
    def __init__(self, round_id: int, ranks: dict[int, tuple[int, ProbeFiles]], *, detect: bool,
                 pid_of: Callable[[int], int | None], exit_of: Callable[[int], int | None],
                 warn: Callable[[str], None], gpu_busy: Callable[[int], int | None] = lambda _: None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        """`ranks`: local rank -> (global rank, its probe files); `pid_of`/`exit_of`: a worker's pid and exit code;
        `gpu_busy`: a local rank's GPU utilization now, % (None: it has no GPU, or NVML is not there)."""
        self.round = RoundSteps(round_id)
        self._ranks = {lr: _Rank(lr, rank, files) for lr, (rank, files) in ranks.items()}
        self._detect = detect
        self._pid_of, self._exit_of = pid_of, exit_of
        self._gpu_busy = gpu_busy
        self._warn = warn
        self._clock, self._wall = clock, wall
        self._next_report: float | None = None    # when the stall under way is reported again (None: none is)
        self._told = (-1, -1, 0)      # the newest digest's step, held step and ranks resumed a note was sent for

    async def run(self, put: Put) -> None:
        """Look every LOOK_S until cancelled; put a `RanksStalled` fact for each report."""
        while True:
            await self.tick(put)
            await asyncio.sleep(LOOK_S)    # the watch's period: records change with no event to wait on

    async def tick(self, put: Put) -> None:
        """One look; a stall examined, and reported, when one is due."""
        self.look()
        if self.news_due():
            put(NoteDue(self.round.round_id))
        stalled = self.round.stalled(self._wall()) if self._detect else []
        wall = self._wall()
        if not stalled:
            self._next_report = None
        elif self._next_report is None or wall >= self._next_report:
            first = self._next_report is None
            self._next_report = next_report_at(wall, self.round.threshold_s())
            seen = await self.examine()
            if not self.round.stalled(self._wall()):
                # Every rank stepped while watched: the stall is over, and what was seen is its end (a rank caught
                # entering the collective its peers waited in is no rank alone, "for 0s"). Nothing is reported.
                self._next_report = None
                return
            put(RanksStalled(self.round.round_id, self.round.threshold_s(), seen, first))

    def news_due(self) -> bool:
        """Whether the server should hear this node now: a new digest or hold, or a rank that resumed (its agreement
        removed the snapshots the job went back from: the note its agent sent as the workers started still names
        them, and a held floor worked out from it has the ranks ahead drop the step a slower rank holds; a review
        saw every rank of a job of shards go back to step 0)."""
        news = (self.round.newest_digest(), self.round.held_step(), self.round.resumed_ranks())
        due = any(n > t for n, t in zip(news, self._told, strict=True))    # each on its own: a hold ended is no news
        self._told = (max(news[0], self._told[0]), news[1], max(news[2], self._told[2]))
        return due

    def look(self) -> None:
        now, wall = self._clock(), self._wall()
        for r in self._ranks.values():
            code = self._exit_of(r.local_rank)
            if code is not None:
                seen = self.round.ranks.get(r.local_rank)
                if seen is None or seen.exited is None:    # its last word: a round shorter than a look counts too
                    self.round.observe(r.local_rank, self._record(r, None, wall), None, now, wall)
                self.round.exited(r.local_rank, code)
                continue
            pid = self._pid_of(r.local_rank)
            self.round.observe(r.local_rank, self._record(r, pid, wall), read_proc(pid) if pid else None, now, wall)

    def note(self) -> ProgressNote:
        return self.round.note(self._clock())

    def close(self) -> None:
        for r in self._ranks.values():
            if r.reader is not None:
                r.reader.close()
                r.reader = None

    def _record(self, r: _Rank, pid: int | None, wall: float) -> ProbeRecord | None:
        if r.ignored:
            return None
        try:
            if r.reader is None:
                r.reader = RecordReader(r.files.record)
            return r.reader.read(pid, wall)
        except BadRecord as exc:
            r.ignored = True
            self._warn(f"rank {r.rank} (local {r.local_rank}): its progress record is not one ({exc}); "
                       f"ignored for this round")
        except (OSError, ValueError):
            pass      # not there yet, or gone with the round
        return None

    async def examine(self) -> tuple[RankSeen, ...]:
        """Every local rank's state now: EXAMINE_DUMPS looks EXAMINE_GAP_S apart, with stacks at each."""
        before = {lr: self.round.ranks[lr].proc if lr in self.round.ranks else None for lr in self._ranks}
        started = self._clock()
        gpu: dict[int, list[int]] = {lr: [] for lr in self._ranks}
        dumps = []
        for i in range(EXAMINE_DUMPS):
            if i:
                await asyncio.sleep(EXAMINE_GAP_S)     # the gap between the looks is the measurement
            dumps.append(await take_stacks(self._answering()))
            for lr, samples in gpu.items():
                busy = self._gpu_busy(lr)
                if busy is not None:
                    samples.append(busy)
        self.look()
        watched = self._clock() - started + LOOK_S
        wall = self._wall()
        budget = max(256, min(MAX_TRACEBACK, STACKS_BUDGET // max(1, len(self._ranks))))
        seen = []
        for lr, r in sorted(self._ranks.items()):
            rank = self.round.ranks[lr]      # look() has just seen every rank
            record, ahead, after = rank.record, before.get(lr), rank.proc
            stacks = [s for s in (main_stack(d.get(lr, ""), record.main_thread if record else 0) for d in dumps) if s]
            busy = max(gpu[lr]) if gpu[lr] else None
            state, cpu = classify(ahead, None if rank.exited is not None else after, watched, stacks, busy)
            top = stacks[-1] if stacks else []
            moved = after.io_bytes - ahead.io_bytes if ahead is not None and after is not None else 0
            used = (after.process_cpu_s - ahead.process_cpu_s) / watched \
                if ahead is not None and after is not None and watched > 0 else 0.0
            stalled_s = min(MAX_DURATION_S, max(0.0, wall - record.last_at)) if record and record.steps else 0.0
            seen.append(RankSeen(
                rank=r.rank, local_rank=lr, state=state, cpu=round(cpu, 3), exitcode=rank.exited,
                stalled_s=round(stalled_s, 3),
                steps=record.steps if record else 0, where=keep_tail(str(top[0]) if top else "", MAX_SHORT_TEXT),
                stack=stack_text(top, budget),
                call=keep_tail(call_of(top), MAX_SHORT_TEXT) if state == RankState.WAITING else "",
                io_bytes=min(MAX_ROUND, max(0, moved)), process_cpu=round(min(64.0, max(0.0, used)), 3),
                gpu_busy=-1 if busy is None else max(0, min(100, busy))))
        return tuple(seen)

    def _answering(self) -> dict[int, tuple[int, str]]:
        """The ranks whose probe answers for stacks, and that can (not stopped, not gone)."""
        out = {}
        for lr, r in self._ranks.items():
            rank, pid = self.round.ranks.get(lr, RankSteps()), self._pid_of(lr)   # RankSteps(): not looked at yet
            record = rank.record
            if record is None or not record.flags & probe.STACKS or pid is None or pid != record.pid:
                continue
            if rank.exited is not None or rank.proc is None or rank.proc.state in ("T", "t", "Z", "X"):
                continue
            out[lr] = (pid, r.files.stacks)
        return out

