"""The local ranks' snapshots as peer copies see them (peers.py): the step all of them hold, and the mark that
says a copy of theirs is on its way from a peer. Plain file operations."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Awaitable

from node_agent.training import snapshot


def mark_fetching(dirs: dict[int, str], on: bool) -> None:
    """snapshot.FETCHING in each rank's directory (or not): its copy is on its way from a peer."""
    for where in dirs.values():
        mark = os.path.join(where, snapshot.FETCHING)
        with contextlib.suppress(OSError):
            if on:
                open(mark, "w").close()       # noqa: SIM115 - an empty file: its name is the message
            else:
                os.unlink(mark)


async def while_marked(dirs: dict[int, str], fetching: Awaitable[None]) -> None:
    """`fetching` awaited with each rank's directory marked (mark_fetching): the workers wait for it, to its end."""
    try:
        await fetching
    finally:
        mark_fetching(dirs, False)


def written_since(path: str, since: float) -> bool:
    """`path` was written at `since` or later (False: gone)."""
    try:
        return os.stat(path).st_mtime >= since
    except OSError:
        return False


def common_step(dirs: dict[int, str], at_most: int | None = None) -> dict[int, tuple[int, str]]:
    """local rank -> (step, its file) of the step every local rank has saved (the oldest newest; none past
    `at_most`): pushed once the last rank's save is done, so a copy never competes with a save of that step, and a
    holder gets one step for all of them. {} while a rank has none."""
    held = {rank: max((s for s in snapshot.steps(where) if at_most is None or s <= at_most), default=None)
            for rank, where in dirs.items()}
    steps = [s for s in held.values() if s is not None]
    if not steps or len(steps) < len(held):
        return {}
    step = min(steps)
    return {rank: (step, snapshot.path(step, where)) for rank, where in dirs.items()
            if os.path.exists(snapshot.path(step, where))}


def lag_line(rank: int, step: int, kept: list[int], bandwidth: int) -> str:
    """A copy that landed after its rank let its step go: were this node lost, the node taking its place would
    resume from a step the others may no longer keep. What to say, with what to change ("": it did not lag)."""
    if not kept or step >= kept[0]:
        return ""
    rate = f"{bandwidth / 2**20:.0f} MiB/s" if bandwidth else "unlimited"
    return (f"peer copies lag behind the snapshots: local rank {rank}'s copy of step {step} landed when the rank "
            f"kept only steps {kept[0]}..{kept[-1]}. Were this node lost, the node taking its place would resume "
            f"from a step the others may no longer keep (a job whose ranks hold shards of their own then resumes "
            f"from disk or step 0): give copies more bandwidth (--replica-bandwidth, {rate} now), snapshot less "
            f"often, or keep more")
