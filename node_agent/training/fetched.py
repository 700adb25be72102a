"""Which of a rank's snapshots the agent fetched from a peer's copy (its node's memory was lost: a host rebooted under
its node id, or a node taking a gone one's place). A copy may lag the job by several snapshots (copies slower than
snapshots), so `snapshot.agreed_step` counts a rank whose newest step is such a copy as behind wherever replicas
hold newer steps, rather than as a node whose own memory stopped there: two nodes of DDP make a tie, and a tie keeps
the older step (a review: a 2-node DDP job whose restarted node found its memory wiped went back 31 steps, to its
lagging copy, while the other node held the newest). The mark names the file, not only the step: a snapshot the rank
writes later under that name is its own. Standard library only (the agent writes it, the worker reads it)."""
from __future__ import annotations

import contextlib
import os

FETCHED = ".fetched"    # in a rank's directory: "STEP INODE SIZE MTIME_NS" of the copy fetched there


def mark(where: str, step: int) -> None:
    """Note that `step-STEP` in `where` is a fetched copy (nothing where it cannot be written: the rank then counts
    as one at that step, as before)."""
    with contextlib.suppress(OSError):
        st = os.stat(os.path.join(where, f"step-{step}"), follow_symlinks=False)
        new = os.path.join(where, FETCHED + ".new")
        with open(new, "w", encoding="ascii") as f:
            f.write(f"{step} {st.st_ino} {st.st_size} {st.st_mtime_ns}")
        os.replace(new, os.path.join(where, FETCHED))


def is_copy(where: str | None, step: int) -> bool:
    """Whether `step-STEP` in `where` is the very file the agent fetched (its mark names it)."""
    if where is None:
        return False
    try:
        with open(os.path.join(where, FETCHED), encoding="ascii") as f:
            told = f.read(80).split()
        st = os.stat(os.path.join(where, f"step-{step}"), follow_symlinks=False)
    except (OSError, UnicodeDecodeError):
        return False
    return told == [str(step), str(st.st_ino), str(st.st_size), str(st.st_mtime_ns)]
