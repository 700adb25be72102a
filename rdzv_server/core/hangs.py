"""Whether a job hangs, from what the agents of its running round saw of their stalled ranks (StallReport).
Only the server hears every node, so only it decides; pure, `now` is an argument.

A hang: some rank waits on the others (in a collective or a wait) while another will not come: it is stopped,
gone, spinning in its own code or idle outside any collective; that rank is the culprit, the root cause. Ranks
that compute (an eval loop, a checkpoint write, data loading) are left alone, for as long as it takes, but for
the hard cap: ranks waiting on the others longer than the job's `hang_timeout_s` are a hang whatever the others
do. Nothing is decided before every running member has sent a fresh report, all within TOGETHER_S of each other:
a node still stepping sends none.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from protocol.messages import RankSeen, RankState, StallReport

FRESH_MIN_S = 10.0      # a report is evidence for max(this, twice its threshold): the agent re-sends it meanwhile
TOGETHER_S = 2.0        # the running members' reports are this close in time, or they saw different moments
# The likelier culprit first: a rank that cannot run, then one gone, then one looping, then one idle.
CULPRIT_ORDER = (RankState.STOPPED, RankState.EXITED, RankState.SPINNING, RankState.QUIET)


@dataclass
class StallBoard:
    """The reports of one round of one job, by node (memory only: agents re-send them while a stall lasts)."""
    round_id: int
    reports: dict[str, tuple[float, StallReport]] = field(default_factory=dict)

    def fresh(self, now: float) -> dict[str, StallReport]:
        return {node: report for node, (at, report) in self.reports.items()
                if now - at <= max(FRESH_MIN_S, 2 * report.threshold_s)}


@dataclass(frozen=True)
class Hang:
    node_id: str
    culprit: RankSeen
    waiting: list[RankSeen]
    seen: list[tuple[str, RankSeen]]       # every rank reported, with its node
    capped: bool                           # decided by the hard cap, not by a culprit

    @property
    def message(self) -> str:
        c = self.culprit
        ranks = _ranks(r.rank for r in self.waiting)
        longest = max(r.stalled_s for r in self.waiting)
        where = _where_waiting(self.waiting)
        if self.capped:
            return (f"{ranks} waited on the others for {longest:.0f}s{where} (hang timeout); rank {c.rank} was "
                    f"{c.state.value}{_at(c)}")
        return f"rank {c.rank} {_how(c)}{_at(c)} while {ranks} waited for it{where}"


def decide(board: StallBoard, running: list[str], finished: dict[str, list[int]], hang_timeout_s: float,
           now: float) -> Hang | None:
    """The hang, if the reports show one. `running`: the round's members still running workers; `finished`: the
    members whose workers all exited 0, with their ranks."""
    fresh = board.fresh(now)
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
    waiting = [r for _, r in seen if r.state == RankState.WAITING]
    if not waiting:
        return None
    culprits = sorted((CULPRIT_ORDER.index(r.state), r.rank, node, r) for node, r in seen if r.state.culprit)
    if culprits:
        _, _, node, culprit = culprits[0]
        return Hang(node, culprit, waiting, seen, capped=False)
    if hang_timeout_s > 0 and max(r.stalled_s for r in waiting) >= hang_timeout_s:
        others = sorted((r.state == RankState.WAITING, r.rank, node, r) for node, r in seen)
        _, _, node, culprit = others[0]
        return Hang(node, culprit, waiting, seen, capped=True)
    return None


def _how(r: RankSeen) -> str:
    if r.state == RankState.EXITED:
        return f"exited{f' with code {r.exitcode}' if r.exitcode is not None else ''}"
    return {RankState.STOPPED: "was stopped", RankState.SPINNING: "spun in its own code",
            RankState.QUIET: f"sat idle for {r.stalled_s:.1f}s"}.get(r.state, str(r.state.value))


def _at(r: RankSeen) -> str:
    return f" at {r.where}" if r.where else ""


def _where_waiting(waiting: list[RankSeen]) -> str:
    places = {r.where for r in waiting if r.where}
    return f" (in {places.pop()})" if len(places) == 1 else ""


def _ranks(ranks: Iterable[int]) -> str:
    """'rank 3', 'ranks 0-2', 'ranks 0-2, 5'."""
    nums = sorted(set(ranks))
    spans: list[str] = []
    start = prev = nums[0]
    for n in [*nums[1:], None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if n is not None:
            start = prev = n
    return f"rank{'s' if len(nums) > 1 else ''} {', '.join(spans)}"
