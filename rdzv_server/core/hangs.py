"""Whether a job's stalled ranks hang, from what the agents of its running round saw (StallReport). Only the
server hears every node, so only it decides; pure, `now` is an argument.

Reports of one moment only: nothing is assessed before every running member has sent a fresh report, all within
TOGETHER_S of each other (a node still stepping sends none). Then, while some rank waits on the others:
- **certain**, decided at once: a rank stopped, or gone (it exited while the others wait; one that exited 0 only
  while no other rank works apart, which they may wait on instead); or a **deadlock**: every rank waiting, none
  computing (in any of its threads), no data moving and no GPU busy. A deadlock's culprit is
  the rank whose call differs from the others' (the fewest ranks making one call), else the lowest rank.
- **alone**: a rank apart (working, idle or spinning in its own code, or not answering) while the others wait. An
  evaluation, an upload or a polling loop looks exactly like a rank hung there, so it is shown at once and decided
  a hang only after `hang_alone_timeout_s`.
- **moving**: every rank waiting while data still moves or a process or GPU computes (a long collective; on a GPU,
  a stuck NCCL kernel looks the same): decided only after the hard cap, `hang_timeout_s`.
A limit's decision may be wrong, and would be again after every restart: a place (where the culprit went its
own way) once decided is excused for the rest of the job.
"""
from __future__ import annotations

import enum
import itertools
import re
from collections import defaultdict
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field, replace

import msgspec

from protocol.messages import JobConfig, StallReport
from protocol.stalls import APART_STATES, CERTAIN_STATES, GPU_BUSY, RankSeen, RankState

FRESH_MIN_S = 10.0      # a report is evidence for max(this, 4x its threshold): the agent re-sends it meanwhile
FRESH_THRESHOLDS = 4.0  # (at most every 2 thresholds: node_agent/core/progress.py's report_period)
TOGETHER_S = 2.0        # the running members' reports are this close in time, or they saw different moments
QUIET_BYTES = 64 * 1024  # a waiting rank's process moved less while watched: no collective of it is progressing
BUSY_PROCESS = 0.1      # ... and used at least this much of a CPU in all its threads: its collective still works
STEPS_BEHIND = 1        # a report's ranks this many steps behind the job's known steps still tell of its stall
MAX_PLACE = 2048        # characters of a place kept (its outermost frames go first)
MAX_PLACES = 32         # places one job keeps (the oldest go first)
PLACE_LINES = 10        # an innermost line this close to a place's is that place (a loop's other lines)
_NOT_SCRIPT = ("/torch/", "/site-packages/", "/dist-packages/", "/lib/python3", "<frozen ")   # frames not the script's
_LINE = re.compile(r":(\d+) in ")
_LOOSE = re.compile(r"(?P<file>.*):~(?P<line>\d+) in (?P<function>.*)")


class StallKind(str, enum.Enum):
    CULPRIT = "culprit"        # a rank stopped or gone while the others wait: certain
    DEADLOCK = "deadlock"      # every rank waiting, nothing moving: certain
    ALONE = "alone"            # a rank apart while the others wait: a hang after hang_alone_timeout_s
    MOVING = "moving"          # every rank waiting, data moving: a hang after hang_timeout_s

    @property
    def certain(self) -> bool:
        return self in (StallKind.CULPRIT, StallKind.DEADLOCK)


@dataclass
class StallBoard:
    """The reports of one round of one job, by node (memory only: agents re-send them while a stall lasts)."""
    round_id: int
    reports: dict[str, tuple[float, StallReport]] = field(default_factory=dict)

    def fresh(self, now: float, steps: int = 0) -> dict[str, StallReport]:
        """The reports that are evidence now: recent, and not older than the steps the job is known to have taken
        (`steps`, from the progress notes: a report examined just before the ranks stepped again, and received
        after, tells of a stall that is over)."""
        return {node: report for node, (at, report) in self.reports.items()
                if now - at <= max(FRESH_MIN_S, FRESH_THRESHOLDS * report.threshold_s)
                and max(r.steps for r in report.ranks) + STEPS_BEHIND >= steps}


@dataclass(frozen=True)
class Stall:
    """What the reports of one moment show: a kind, the rank to blame (its node), the ranks waiting, every rank
    seen. `decided`: a hang now; `excused`: it would be one, but its place was decided before in this job."""
    kind: StallKind
    node_id: str
    culprit: RankSeen
    odd: list[RankSeen]                    # a deadlock's ranks whose call differs (the culprit first)
    waiting: list[RankSeen]
    seen: list[tuple[str, RankSeen]]
    place: str                             # where the culprit went its own way (ALONE, MOVING)
    limit_s: float                         # the limit that applies (0: none; certain kinds need none)
    decided: bool
    excused: bool = False

    @property
    def spell_s(self) -> float:
        """How long the job has not stepped: the longest stall of the ranks concerned."""
        return max(r.stalled_s for r in [self.culprit, *self.waiting])

    @property
    def capped(self) -> bool:
        """Decided by a limit, not by certain evidence."""
        return self.decided and not self.kind.certain

    @property
    def message(self) -> str:
        """One line: the decision if decided, else what is shown while it lasts."""
        c = self.culprit
        if self.kind is StallKind.CULPRIT:
            waiting = _ranks(r.rank for r in self.waiting if r.rank != c.rank)
            return f"rank {c.rank} {_how(c)}{_at(c)} while {waiting} waited for it{_calls(self.waiting)}"
        if self.kind is StallKind.DEADLOCK:
            return f"deadlock: every rank waits on the others, none computing and no data moving; {_odd(self)}"
        line = self.shown(0.0).text(self.spell_s)
        if not self.decided:
            return line
        return f"{line} ({'--hang-alone-timeout' if self.kind is StallKind.ALONE else 'hang timeout'} " \
               f"{self.limit_s:.0f}s)"

    def shown(self, now: float) -> StallShown:
        """What the status shows while it lasts ("rank 0 alone for 42s at ...; ranks 1-3 waiting in all_reduce")."""
        c = self.culprit
        if self.kind is StallKind.ALONE:
            apart = [c.rank, *(r.rank for _, r in self.seen if r.state.apart and r.rank != c.rank)]
            waiting = _ranks(r.rank for r in self.waiting)
            head, tail = f"{_ranks(apart)} alone", f"{_at(c)}; {waiting} waiting{_calls(self.waiting)}"
        else:
            head, tail = f"{_ranks(r.rank for r in self.waiting)} in collectives", \
                f"{_calls(self.waiting)}, still moving data or computing"
        return StallShown(kind=self.kind.value, head=head, tail=tail, since=now - self.spell_s,
                          excused=self.excused)


class HangPlace(msgspec.Struct, kw_only=True):
    """A place a limit decided a hang at (place_of): excused for the rest of the job (saved with it)."""
    place: str
    round_id: int
    rank: int


class StallShown(msgspec.Struct, kw_only=True):
    """A stall shown while it lasts (saved with the job): '{head} for {seconds}s{tail}'."""
    kind: str                  # a StallKind value
    head: str
    tail: str
    since: float               # when its ranks last stepped
    excused: bool = False      # its place was decided a hang before: it will not be again
    round_id: int = -1
    steps: int = 0             # the round's steps when shown: once it steps again, the stall is over
    fresh_until: float = 0.0   # shown until then unless reported again

    def line(self, now: float) -> str:
        return self.text(max(0.0, now - self.since))

    def text(self, seconds: float) -> str:
        return f"{self.head} for {seconds:.0f}s{self.tail}"


def assess(board: StallBoard, running: list[str], finished: dict[str, list[int]], config: JobConfig,
           excused: Collection[str], now: float, steps: int = 0) -> Stall | None:
    """The stall the reports show, if one: `running` the round's members still running workers, `finished` the
    members whose workers all exited 0 (with their ranks), `excused` the places decided before in this job,
    `steps` the most steps a rank of the round is known to have taken (progress notes)."""
    fresh = board.fresh(now, steps)
    if not running or any(node not in fresh for node in running):
        return None
    # A node's report of a rank computing, seconds before another's of ranks waiting, is no hang: wait for
    # reports of one moment (each node re-sends every threshold while its stall lasts).
    seen_at = [board.reports[node][0] for node in running]
    if max(seen_at) - min(seen_at) > TOGETHER_S:
        return None
    seen = [(node, r) for node in running for r in fresh[node].ranks]
    seen += [(node, RankSeen(rank=rank, local_rank=i, state=RankState.EXITED, stalled_s=0.0, exitcode=0))
             for node, ranks in finished.items() for i, rank in enumerate(ranks)]
    waiting = sorted(((node, r) for node, r in seen if r.state == RankState.WAITING), key=lambda s: s[1].rank)
    if not waiting:
        return None                         # nobody waits on anybody: ranks at work, or finishing
    if finished and max(r.steps for _, r in waiting) < steps:
        return None     # ranks stepped past these waits and finished: the wait was over (a healthy job's end, loaded)
    waits = [r for _, r in waiting]
    # A rank that finished (exit 0) while another still works apart and the rest wait is no certain culprit: the
    # wait may be on the working rank, in a collective of a group the finished ones are not in (a node-local
    # barrier while local rank 0 writes its node's files at the end). The working rank is shown alone instead.
    working = any(r.state.apart for _, r in seen)
    certain = sorted(((CERTAIN_STATES.index(r.state), r.rank, node, r) for node, r in seen if r.state.certain
                      and not (working and r.state == RankState.EXITED and r.exitcode == 0)))
    if certain:
        _, _, node, culprit = certain[0]
        return Stall(StallKind.CULPRIT, node, culprit, [], waits, seen, "", 0.0, decided=True)
    apart = sorted((APART_STATES.index(r.state), r.rank, node, r) for node, r in seen if r.state.apart)
    if not apart:
        odd = _odd_ones(waiting)
        node, culprit = (odd or waiting)[0]
        if not any(_moving(r) for r in waits):
            return Stall(StallKind.DEADLOCK, node, culprit, [r for _, r in odd], waits, seen, "", 0.0, decided=True)
        kind, limit = StallKind.MOVING, config.hang_timeout_s
        others = [r for r in waits if r.rank != culprit.rank]
    else:
        _, _, node, culprit = apart[0]
        kind, limit, odd, others = StallKind.ALONE, config.hang_alone_timeout_s, [], waits
    place = place_of(culprit, others)
    stall = Stall(kind, node, culprit, [], waits, seen, place, limit, decided=False,
                  excused=any(same_place(place, p) for p in excused))
    if limit > 0 and stall.spell_s >= limit and not stall.excused:
        return replace(stall, decided=True)
    return stall


def place_of(culprit: RankSeen, waiting: Iterable[RankSeen]) -> str:
    """Where the culprit went its own way: its frames from the outermost down to the first that differs from every
    waiting rank's (the line of the script the others went past), one per line. The work below it may move from
    one look to the next; the line it was called from is the same after a restart."""
    mine = _outer_first(culprit.stack)
    if not mine:
        return culprit.where
    common = [_shared(mine, _outer_first(w.stack)) for w in waiting if w.stack]
    depth = min(max(common), len(mine) - 1) if common else len(mine) - 1
    frames = mine[:depth + 1]
    if depth == len(mine) - 1:       # the innermost frame's line is where its work is now, not a call: it moves
        frames[-1] = _LINE.sub(r":~\1 in ", frames[-1], count=1)
    return "\n".join(frames)[-MAX_PLACE:]


def same_place(a: str, b: str) -> bool:
    """Two places are one: the same frames, but that an innermost line (`:~N`) may be PLACE_LINES away (a loop
    caught on another of its lines)."""
    if a == b:
        return True
    *outer_a, last_a = a.split("\n")
    *outer_b, last_b = b.split("\n")
    loose_a, loose_b = _LOOSE.fullmatch(last_a), _LOOSE.fullmatch(last_b)
    if outer_a != outer_b or loose_a is None or loose_b is None:
        return False
    return (loose_a["file"], loose_a["function"]) == (loose_b["file"], loose_b["function"]) \
        and abs(int(loose_a["line"]) - int(loose_b["line"])) <= PLACE_LINES


def _outer_first(stack: str) -> list[str]:
    return [line.strip() for line in reversed(stack.splitlines()) if line.strip()]


def _shared(a: list[str], b: list[str]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _moving(r: RankSeen) -> bool:
    """A waiting rank whose collective still works: its process moves data, computes in another thread (a big
    all-gather copies its output for seconds after its last byte came), or its GPU does."""
    return r.io_bytes >= QUIET_BYTES or r.process_cpu >= BUSY_PROCESS or r.gpu_busy >= GPU_BUSY


def _odd_ones(waiting: list[tuple[str, RankSeen]]) -> list[tuple[str, RankSeen]]:
    """The ranks whose call differs from the others': those of the call the fewest ranks make (a tie: the one
    with the lowest rank); none when every rank makes one call."""
    by_call: dict[str, list[tuple[str, RankSeen]]] = defaultdict(list)
    for node, r in waiting:
        by_call[r.call].append((node, r))
    if len(by_call) < 2:
        return []
    return min(by_call.values(), key=lambda group: (len(group), group[0][1].rank))


def _odd(stall: Stall) -> str:
    c = stall.culprit
    if not stall.odd:
        call = f" in {c.call}" if c.call else ""
        return (f"every rank waits{call}: no rank's call differs (a collective skipped or called in another order "
                f"before this one); the lowest rank is named")
    odd = {r.rank for r in stall.odd}
    rest = [r for r in stall.waiting if r.rank not in odd]
    rest_ranks = {r.rank for r in rest}
    return (f"{_ranks(odd)} wait{'s' if len(odd) == 1 else ''} in {c.call or 'an unknown call'}{_at_script(c)} "
            f"while {_ranks(rest_ranks)} wait{'s' if len(rest_ranks) == 1 else ''}{_calls(rest)}")


def _at_script(r: RankSeen) -> str:
    """' at train.py:40 in main': the script's line the rank waits from (its innermost frame outside torch, the
    libraries and Python's own), which a restart does not mend; the innermost frame where its stack has none."""
    line = next((f for f in r.stack.splitlines() if f.strip() and not any(p in "/" + f for p in _NOT_SCRIPT)), "")
    return f" at {line.strip()}" if line else _at(r)


def _how(r: RankSeen) -> str:
    if r.state == RankState.EXITED:
        return f"exited{f' with code {r.exitcode}' if r.exitcode is not None else ''}"
    return "was stopped" if r.state == RankState.STOPPED else str(r.state.value)


def _at(r: RankSeen) -> str:
    return f" at {r.where}" if r.where else ""


def _calls(waiting: list[RankSeen]) -> str:
    """' in all_reduce' when the waiting ranks wait in one call (else where they wait, if one place)."""
    calls = {r.call for r in waiting}
    if len(calls) == 1 and "" not in calls:
        return f" in {calls.pop()}"
    places = {r.where for r in waiting if r.where}
    return f" (in {places.pop()})" if len(places) == 1 else ""


def _ranks(ranks: Iterable[int]) -> str:
    """'rank 3', 'ranks 0-2', 'ranks 0-2, 5'."""
    nums = sorted(set(ranks))
    if not nums:
        return "no rank"
    # a run of consecutive numbers keeps the same difference between each number and its position
    runs = [[n for _, n in run] for _, run in itertools.groupby(enumerate(nums), lambda p: p[1] - p[0])]
    spans = [str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs]
    return f"rank{'s' if len(nums) > 1 else ''} {', '.join(spans)}"
