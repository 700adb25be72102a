"""The steps a round's members keep their snapshots by (NodeStatus.copies_floor, held_floor), worked out from the
notes their polls carry (CopiesNote): besides their keep rule and within the memory limit, each member's ranks keep
every snapshot from the copies floor on, and the held floor's step with the newest snapshot the keep rule lets go
where it is of the held floor or later (node_agent/training/snapshot.py: KEEP_FROM).

A floor only ever lags: worked out from notes that may be old, it is at most the step each member holds, so the
ranks keep more meanwhile, never less. Worked out again where a note moves it, at most every HELD_EVERY_S for a
member's newest snapshot (each member's moves with every snapshot: a thousand members' polls over a thousand notes
would be a million looks), and every FLOOR_EVERY_S while notes come (a member's copy stuck).
"""
from __future__ import annotations

from protocol.notes import CopiesNote
from rdzv_server.core.records import JobRecord, NodeRecord

COPY_STUCK_S = 60.0     # a member whose pushes are refused and whose copy has not moved this long: out of the floor
FLOOR_EVERY_S = 5.0     # the floors are worked out again at least this often while notes come
HELD_EVERY_S = 0.5      # ... and at most this often for a member's newest snapshot alone
HELD_STUCK_S = 60.0     # a member whose newest snapshot lags the others' and has not moved this long: out of it
HELD_STUCK_SNAPSHOTS = 2    # ... nor for this many of the newest members' snapshot intervals (one write that failed)


def refresh(job: JobRecord, now: float) -> None:
    job.copies_floor, job.held_floor, job.copies_floor_at = copies_floor(job, now), held_floor(job, now), now


def restored(job: JobRecord, now: float, away_s: float) -> None:
    """After the server came back, `away_s` after it went: no member's newest snapshot or copy counts as stuck for
    the time its notes could not come (a review: after 3 minutes away, the first note made every slower member
    stuck, and the ranks ahead dropped the step it held)."""
    for node in job.nodes.values():
        node.stepped_at, node.copied_at = min(now, node.stepped_at + away_s), min(now, node.copied_at + away_s)
    job.restored_at = now      # notes before it are the saved figures, not news (views: copies_before_restart)


def noted(job: JobRecord, node: NodeRecord, before: CopiesNote | None, note: CopiesNote, now: float) -> None:
    """A member's poll said `note` (its last said `before`): its record, and the floors where it moves them."""
    first = job.round is not None and node.noted_at < job.round.completed_at       # its first note of the round
    node.copies, node.noted_at = note, now
    if before is None or note.copied_step != before.copied_step:
        node.copied_at = now
    if before is None or note.local_step != before.local_step:
        if before is not None and 0 <= before.local_step < note.local_step and job.round is not None and \
                node.stepped_at >= job.round.completed_at:
            node.step_gap = now - node.stepped_at       # its snapshots' interval, as its notes tell it
        node.stepped_at = now
    # A note below a floor may bring it down: at once. One that moves a step up may only raise it, and a floor that
    # lags keeps more meanwhile, never less: at most every HELD_EVERY_S (a review: each copy's note worked both out
    # again over every member, 21 ms at 10,000 members, 70 s of the event loop for one copy of each)
    if before is None or (before.refused, before.local_step < 0) != (note.refused, note.local_step < 0):
        refresh(job, now)      # a member that says anew whether it holds or copies anything
        return
    below = max(0, note.copied_step) < job.copies_floor or 0 <= note.local_step < job.held_floor     # (-1 counts 0)
    rises = first or (note.local_step, note.copied_step) != (before.local_step, before.copied_step)
    since = now - job.copies_floor_at
    if below or since >= FLOOR_EVERY_S or (rises and since >= HELD_EVERY_S):
        refresh(job, now)


def held_floor(job: JobRecord, now: float) -> int:
    """The oldest of the round's members' newest snapshots, every local rank's (NodeStatus.held_floor; -1: none).
    The ranks ahead keep it while a slower one still writes its next (a write longer than the snapshots' interval,
    a rank with more state): a failure then finds a step every rank holds, and the job resumes from memory rather
    than disk or step 0 (a job of shards has no replica to lend one). Ranks step together, so the slowest rank's
    newest is at most one older than what a rank's keep rule keeps: a rank keeps that one more, where it is of the
    floor or later (a floor that lags costs one snapshot). In the round's first HELD_STUCK_S, 0 while a member has
    not said what it holds since the round formed (its last note may be of steps the job went back from) or holds
    none yet: the round's first snapshots come before its note. Past that, such a member does not count (it has no
    memory directory, say), nor one whose newest lags the others' and has not moved for HELD_STUCK_S and
    HELD_STUCK_SNAPSHOTS of the newest members' intervals (its writes fail): the others would keep one more snapshot
    for it for good. One write that failed, where snapshots are far apart, is not that."""
    r = job.round
    if r is None:
        return -1
    said: list[tuple[int, float, float]] = []
    for m in r.members:
        node = job.nodes.get(m)
        if node is not None and node.copies is not None and node.copies.local_step >= 0 and \
                node.noted_at >= r.completed_at:
            said.append((node.copies.local_step, node.stepped_at, node.step_gap))
    if len(said) < len(r.members) and now - r.completed_at <= HELD_STUCK_S:
        return 0
    newest = max((step for step, _, _ in said), default=-1)
    # Stuck is counted in snapshots as well as seconds: where snapshots are more than half a minute apart, one write
    # that failed left a member a minute behind (a review: the ranks ahead then dropped the one step it held)
    interval = max((gap for step, _, gap in said if step == newest), default=0.0)
    stuck_s = max(HELD_STUCK_S, HELD_STUCK_SNAPSHOTS * interval)
    return min((step for step, at, _ in said if step == newest or now - at <= stuck_s), default=-1)


def copies_floor(job: JobRecord, now: float) -> int:
    """The oldest of the round's members' newest copied steps (NodeStatus.copies_floor): the node taking a lost
    member's place resumes from its copy, no older than this, so every member keeps its snapshots from this step
    on (its copy may be several snapshots behind where copies are slower than snapshots). A member whose first
    copy has not landed (or that has not said yet) makes it 0: that copy may be of any step the others still hold
    (a floor that counted it later could only come down, past snapshots let go meanwhile). One whose pushes are
    refused (its agent says why) with no copy yet, or whose copy has not moved for COPY_STUCK_S since, or with
    snapshots of its own and no copy COPY_STUCK_S after it first said so (a review: a member that never pushed made
    every rank keep every snapshot until the memory directories were full), or that holds no snapshot to copy (no
    memory directory, say), does not count: its copy may never come (or come again), and the others would keep
    every snapshot for it. -1 where the job's rounds make no copies (copies_off)."""
    r = job.round
    if r is None or not r.replicas or job.copies_off:
        return -1
    steps = []
    for m in r.members:
        node = job.nodes.get(m)
        c = node.copies if node is not None else None
        stuck = node is not None and c is not None and (
            c.refused > 0 and (c.copied_step < 0 or now - node.copied_at > COPY_STUCK_S) or
            c.copied_step < 0 and c.local_step >= 0 and now - node.copied_at > COPY_STUCK_S)
        if c is None:
            steps.append(0)
        elif not stuck and (c.copied_step >= 0 or c.local_step >= 0):
            steps.append(max(0, c.copied_step))
    return min(steps, default=-1)
