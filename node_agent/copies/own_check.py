"""A node back at its own place with the memory its previous agent left (its agent restarted) asks its copies' holder
for its newest copy anyway: the memory's newest files may be damaged (a file cut short) or gone for one rank, and a
rank refusing its file sends every rank back a snapshot (agreed_step) though the holder keeps a whole copy of that
step (a review: every rank back from step 10 to 5). The holder's copy lands beside the rank's files, in SIDE, and is
taken where it is newer than the node's newest common step and the rank lacks that step, or of that step and the
rank's own file is missing or shorter than the copy (cut short). A file as long or longer stays: a copy of an older
round (the job went back, this node's newer copies not landed yet) is of steps the job abandoned, and a flipped bit
is the snapshot's own checksums' to find. Plain file operations: the fetch itself is the caller's."""
from __future__ import annotations

import asyncio
import os
import shutil
import ssl
from collections.abc import Callable

from node_agent.copies.client import FetchResult, fetch_ranks
from node_agent.training import snapshot

SIDE = ".holder"        # in a rank's directory: where its holder's copy lands before it is compared (not a step)
FETCH_LIMIT_S = 60.0    # as a node taking a place waits for its copies (peers.py)
# The holder answers at once where its copy port is served; a hung one (its agent stalled, its port cut off) is given
# up sooner than a fetch's FETCH_ANSWER_S: the memory most likely stands, and the workers wait on the check.
CHECK_ANSWER_S = 2.0


def side_dirs(dirs: dict[int, str]) -> dict[int, str]:
    """Each rank's SIDE directory, made empty (one a killed agent left is cleared)."""
    out = {}
    for rank, where in dirs.items():
        side = os.path.join(where, SIDE)
        shutil.rmtree(side, ignore_errors=True)
        os.makedirs(side, mode=0o700, exist_ok=True)
        out[rank] = side
    return out


def ours_stands(mine: str, step: int, size: int, kept: int, at_most: int | None = None) -> bool:
    """The rank's own file `mine` of the holder's `step` (its copy `size` bytes) stands: the copy is older than the
    memory's common step `kept`, or past `at_most` (the job's replicas diverged after it: Assignment.resume_at_most,
    those steps are no rank's future), or the rank holds the step, newer than `kept` or not shorter than the copy (a
    longer file is not cut short: the copy is of another run of that step's, an older round's)."""
    try:
        return step < kept or at_most is not None and step > at_most or \
            os.path.isfile(mine) and not os.path.islink(mine) and (step > kept or os.path.getsize(mine) >= size)
    except OSError:
        return False


def take_newer(dirs: dict[int, str], side: dict[int, str], got: list[FetchResult], kept: int) -> list[int]:
    """The local ranks whose file of the holder's step (one for every rank, `kept` or newer) is now the holder's
    copy, marked fetched (fetched.py); the side directories are removed. A rank whose copy was not sent (its own
    file stands: ours_stands) has none there."""
    try:
        steps = {r.step for r in got}
        step = next(iter(steps)) if len(steps) == 1 and len(got) == len(dirs) else None
        if step is None or step < kept:
            return []
        taken = []
        for rank, where in sorted(dirs.items()):
            theirs, mine = snapshot.path(step, side[rank]), snapshot.path(step, where)
            if not os.path.isfile(theirs) or ours_stands(mine, step, os.path.getsize(theirs), kept):
                continue
            os.replace(theirs, mine)
            snapshot.mark_fetched(where, step)
            taken.append(rank)
        return taken
    except OSError:             # a directory gone with the job: the memory stands as it is
        return []
    finally:
        for where in side.values():
            shutil.rmtree(where, ignore_errors=True)


async def check_own(dirs: dict[int, str], kept: int, holder: tuple[str, int, str, str], rank_limit: int | None,
                    tls: ssl.SSLContext | None, say: Callable[[str], None], at_most: int | None = None) -> None:
    """The holder's newest copy of each rank (`holder`: its address, port, this node's token and id) into its side
    directory (FETCH_LIMIT_S at most), then `take_newer`; said in one line where a rank took it. Only the answers'
    step and size come where the rank's own file stands (ours_stands): a restart's check costs a round trip per
    rank, not its snapshot's bytes. `at_most`: as ours_stands'."""
    def keep(rank: int, step: int, size: int) -> bool:
        return ours_stands(snapshot.path(step, dirs[rank]), step, size, kept, at_most)

    side: dict[int, str] = {}
    got: list[FetchResult] = []
    try:
        side = side_dirs(dirs)
        got = await asyncio.wait_for(fetch_ranks(*holder, side, rank_limit, FETCH_LIMIT_S, tls, spares=False,
                                                 keep=keep, answer_s=CHECK_ANSWER_S), FETCH_LIMIT_S)
    except (OSError, asyncio.TimeoutError):     # none there in time: the memory stands as it is
        got = []
    finally:
        taken = take_newer(dirs, side, got, kept) if side else []
    if failed := [r.reason for r in got if r.step is None and r.reason != "no copy held"]:
        say(f"this node's memory could not be checked against its copies' holder ({failed[0]}): it stands as it is")
    if taken:
        step = got[0].step
        newer = f", newer than the step every local rank held here ({kept})" if step != kept else ""
        say(f"local rank(s) {', '.join(map(str, taken))}: the memory's file of step {step} was missing or cut short: "
            f"took the holder's copy{newer}")


def no_room_line(node: str, addr: str, port: int, noted: int) -> str:
    """What a node back at its place with --no-memory-dir says once ("": nothing to say), its copies' holder at
    `addr`:`port` (its memory gone with its host), `noted` the job's newest noted snapshot step (-1: none): the agent
    has nowhere to put its copies, and a rank without memory sends every rank of the job to its fallback. Said, not
    refused: the node joined, and the job waits for it."""
    if noted < 0:
        return ""
    return (f"--no-memory-dir: node {node} is back at its place in a job with snapshots of step {noted} (this "
            f"node's copies are kept at {addr}:{port}), but it has no memory directory to take them into: every rank "
            f"of the job goes back to its disk checkpoint or step 0. Start this node without --no-memory-dir (its "
            f"memory directory is in /dev/shm, --memory-dir-limit sizes it) to resume from them")
