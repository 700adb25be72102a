"""A node leaving a job that goes on sends its holders the newest step all its ranks hold before its agent exits
(PeerCopies.close): its workers' last write ended as they stopped, and a node that never comes back (a preempted
host's SIGTERM) is replaced from its copy, a snapshot back without it (a review).
- It waits FLUSH_LIMIT_S at most, and where the job keeps the node's place for its next agent (a `systemctl
  restart`), half of what is left of that (flush_limit): the next agent must join within it, else the job goes on
  without it (a second review: every rank of an elastic job of shards back to step 0).
- A push that cannot end in that time at --replica-bandwidth is not begun (a restart would wait for nothing: its
  memory stays for its next agent), and what it waits for is said as it begins."""
from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Protocol

from node_agent.copies.local_steps import common_step

FLUSH_LIMIT_S = 10.0


class Holder(Protocol):      # a Witness: where a holder takes copies
    @property
    def addr(self) -> str: ...
    @property
    def port(self) -> int: ...


def flush_limit(place_left_s: float | None) -> float:
    """How long the last copies may take: FLUSH_LIMIT_S, or half of `place_left_s`, what is left of the place the
    job keeps for this node's next agent (None: none kept)."""
    return FLUSH_LIMIT_S if place_left_s is None else max(0.0, min(FLUSH_LIMIT_S, place_left_s / 2))


def due_bytes(targets: Iterable[Holder], dirs: dict[int, str], pushed: dict[tuple[str, int, int], int],
              at_most: int | None = None) -> int:
    """The bytes of the newest step every local rank holds (none past `at_most`) not yet confirmed at each holder
    (pushes under way included; 0 where the directories went with the job)."""
    total = 0
    try:
        newest = common_step(dirs, at_most)
    except OSError:
        return 0
    for target in targets:
        for rank, (step, path) in newest.items():
            if pushed.get((target.addr, target.port, rank), -1) != step:
                with contextlib.suppress(OSError):
                    total += os.path.getsize(path)
    return total


# A node that ran alone (or whose copies never landed) has no copy before: not promised (a review read "resumes from
# the copy before" where a lone node's job then went back to step 0).
EARLIER = "a node taking its place resumes from an earlier copy where one landed, else from disk or step 0"


async def last_copies(stages: Sequence[tuple[Callable[[], Awaitable[None]], int]], bandwidth: int,
                      say: Callable[[str], None], limit_s: float, left_s: float | None = None) -> None:
    """Each stage's flush (the pushes under way, then those due) in turn, for its due bytes at `bandwidth` (0: no
    cap), in what is `left_s` of the stop's `limit_s` (all of it by default); a stage that cannot end in time after
    those before it is not begun. Said once for all stages, with their total (a review: a replica's two stages, two
    lines). The lines name the stop's whole limit, not a remainder a busy host made 0.0999s."""
    left_s = limit_s if left_s is None else left_s
    if left_s <= 0:
        return
    flushes, due = [], 0
    for flush, stage_due in stages:
        if stage_due and bandwidth and (due + stage_due) / bandwidth > left_s:
            say(f"peer copies: this node's newest snapshot ({stage_due / 2**20:.0f} MiB) is not sent before it "
                f"exits: at --replica-bandwidth {bandwidth / 2**20:.0f} MiB/s it would take "
                f"{(due + stage_due) / bandwidth:.1f}s, more than the {limit_s:.3g}s its stop allows; {EARLIER}")
        elif stage_due:
            flushes.append(flush)
            due += stage_due
    if not due:
        return
    say(f"peer copies: sending this node's newest snapshot ({due / 2**20:.0f} MiB) to its holders before it exits (at "
        f"most {limit_s:.3g}s)")

    async def in_turn() -> None:
        for flush in flushes:
            await flush()
    try:
        await asyncio.wait_for(in_turn(), left_s)
    except (asyncio.TimeoutError, OSError):
        say(f"peer copies: this node's newest snapshot did not reach its holders within {limit_s:.3g}s of its "
            f"stop; {EARLIER}")
