"""In-memory snapshots for a worker: the node agent's memory directory, used from the training script.
Each local rank gets a directory in /dev/shm that outlives worker restarts and is removed when the job
ends or the node leaves (NODE_AGENT_MEMORY_DIR; NODE_AGENT_MEMORY_LIMIT: its size limit in bytes), so a
restarted worker loads its predecessor's snapshot without touching remote storage. No torch import (the
agent imports this): `save` takes bytes or a callable writing into a file, e.g.
`save(lambda f: torch.save(state, f), step)`; load with `torch.load(path(step), mmap=True)` (no copy). Rules:
- A snapshot is the file `step-N`, written as `step-N.tmp` and renamed: a reader never sees half a file.
  Before writing, `save` drops all but the newest `keep - 1`, so the last complete one survives a failed write;
  but for those from the step the agent names in KEEP_FROM (the job's oldest peer copy is of it: a node lost now
  is taken over from a copy no older), and the newest of the others where it is of KEEP_FROM's second step (the
  slowest rank's newest, as the server last heard: a failure while a slower rank writes finds a step all hold).
- What is kept plus the new snapshot must fit the limit: where it does not, older snapshots go too, oldest first
  (a limit that holds fewer than `keep` keeps the newest; a writer's snapshot is taken to be the size of the
  newest), but the newest complete one stays beside the new one until it is complete, past the limit, where the
  file system and the memory have room for both (`fit`); where the new one alone does not fit (or /dev/shm is
  full) `save` raises `MemoryDirFull` naming the limit and sizes, leaving no partial file and the last complete
  one. Catch it and train on: the agent never stops training for it.
- All ranks resume from the same step: `agreed_step` takes the MIN of every rank's newest step, then checks
  every rank holds (and accepts) it (a rank that lost its copy, e.g. a replaced node, sends everyone back to disk).
  Where every rank's state is a replica of every other's (DDP: `lend`), a rank that holds nothing (a node that
  joined a growing job, or lost its memory) or not that step is lent a replica's file instead.
  Snapshots newer than the step agreed (all of them, going back to disk) are removed: the job abandoned those steps.
- While HOLD is in the directory (the server swaps a suspect node at the job's next snapshot), a rank that
  completes a snapshot waits after it (`hold_after`): no rank steps past it, so the job resumes from it with
  nothing redone.
`node_agent.training.protect` does all of this for a torch model and optimizer in one call."""
from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import BinaryIO

from node_agent.training import headroom, heartbeat
from node_agent.training.bounded import FULL, Bounded, MemoryDirFull
from node_agent.training.fetched import is_copy
from node_agent.training.fetched import mark as mark_fetched

__all__ = ["COPY_WAIT_S", "DIR_VAR", "FETCHING", "FULL", "HOLD", "KEEP_FROM", "LIMIT_VAR", "MemoryDirFull", "NONE_HELD",
           "SENDING", "Writer", "agreed_step", "directory", "foreign", "full_error", "Room", "forget_after",
           "keep_from", "limit", "hold_after", "is_copy", "make_room", "mark_fetched", "newest", "path", "remove",
           "save", "steps", "unfinished"]

DIR_VAR = "NODE_AGENT_MEMORY_DIR"
FETCHING = ".fetching"    # the agent is fetching this rank's copy from a peer (node_agent/copies/peers.py)
COPY_WAIT_S = 90.0        # the most agreed_step waits for it (the agent gives up on a fetch after 60 s)
LIMIT_VAR = "NODE_AGENT_MEMORY_LIMIT"
HOLD = ".hold"            # the agent asks this rank to wait after its next snapshot (NodeStatus.hold_at_snapshot)
HOLD_MAX_S = 30.0         # the most it waits: a swap that did not come lets the training go on
KEEP_FROM = ".keep-from"  # the steps the agent asks this rank to keep its snapshots by (`floors`)
SENDING = ".sending-"     # a second name for a snapshot while the agent sends it (copies/files.pin): not written over
HOLD_LOOK_S = 0.02
_NAME = re.compile(r"step-(\d{1,18})")
MAX_STEP = 2**53          # protocol.bounds.MAX_ROUND: the server's bound on the steps the agent reports (local_step)
NONE_HELD = 2**62         # agreed_step with `lend`: what a rank that holds no snapshot offers (it can be lent one)
_FIELD = (1 << 21) - 1    # agreed_step's counts of ranks, three in one 64-bit sum

Writer = Callable[[BinaryIO], object]


def directory(environ: dict[str, str] | None = None) -> str | None:
    """This worker's memory directory, or None (not under node-agent, or switched off)."""
    value = (os.environ if environ is None else environ).get(DIR_VAR)
    return value if value and os.path.isdir(value) else None


def limit(environ: dict[str, str] | None = None) -> int | None:
    """The size limit in bytes of this worker's snapshots (None: none given)."""
    value = (os.environ if environ is None else environ).get(LIMIT_VAR, "")
    return int(value) if value.isdigit() else None


def steps(where: str | None = None) -> list[int]:
    """The complete snapshots' steps, oldest first: regular files `step-N`, N at most MAX_STEP. Nothing else so
    named is one (`foreign`): a symlink written over in place writes its target (a review: a worker wrote its
    snapshot into the file a link named step-1 pointed to), a directory cannot be removed, and a step past what
    the agent may report got its polls refused by the server (its node left the job)."""
    where = where or directory()
    if where is None:
        return []
    return sorted(step for _, step, ours in _named(where) if ours)


def foreign(where: str) -> list[str]:
    """The names in `where` that look like a snapshot's (or a write's) but are no file of ours (`steps`)."""
    tmp = [name for name, ours in _entries(where, ".tmp") if not ours and _NAME.fullmatch(name[:-4])]
    return sorted([name for name, _, ours in _named(where) if not ours] + tmp)


def _named(where: str) -> list[tuple[str, int, bool]]:
    """(name, step, whether it is a file of ours) of each `step-N` in `where`."""
    return [(name, int(m.group(1)), ours and int(m.group(1)) <= MAX_STEP) for name, ours in _entries(where)
            if (m := _NAME.fullmatch(name))]


def _entries(where: str, suffix: str = "") -> list[tuple[str, bool]]:
    """(name, whether it is a regular file: a symlink is not) of each name in `where` ending in `suffix`."""
    with os.scandir(where) as found:
        return [(e.name, e.is_file(follow_symlinks=False)) for e in found if e.name.endswith(suffix)]


def path(step: int, where: str | None = None) -> str:
    where = where or directory()
    if where is None:
        raise FileNotFoundError(f"no memory directory (${DIR_VAR} is not set)")
    return os.path.join(where, f"step-{step}")


def newest(where: str | None = None) -> int | None:
    """The newest complete snapshot's step, or None."""
    held = steps(where)
    return held[-1] if held else None


def agreed_step(reduce_min: Callable[[int], int], where: str | None = None,
                accept: Callable[[int], bool] | None = None,
                lend: Callable[[int, bool], bool] | None = None,
                reduce_sum: Callable[[int], int] | None = None) -> int | None:
    """The newest step every rank holds (and, given `accept`, every rank accepts), or None (then load from disk, or
    start from scratch). `reduce_min(x)` returns the minimum of x over all ranks (every rank calls it the same number
    of times), e.g. an all_reduce with ReduceOp.MIN of a one-element tensor. `accept(step)` is each rank's check of
    its own file (a checksum, the model's keys and shapes): a step refused by any rank sends every rank to the next
    older one that all hold, so the job never loads a mix of steps. With `lend` (every rank's state a replica of
    every other's), the step is the newest every rank that holds any holds, and `lend(step, held)` (every rank
    calls it) hands a replica's file to the ranks that do not hold it: whether every rank now holds and accepts it.
    With `reduce_sum` too (SUM over all ranks), the ranks whose newest step is the candidate are behind the job where
    at least as many lack it and hold newer ones (a node back in an elastic job after the others trained on without
    it, or one whose writes failed), or more hold newer ones as well as it (the node taking a lost one's place with
    its lagging copy, which the others keep for a job of shards: KEEP_FROM): they are lent the newer one. Where fewer
    do, the newer steps are the odd ones (a node that diverged and was held out, say): those ranks are lent the
    candidate, as before."""
    where = where or directory()
    if where is not None:
        _await_copy(where)
        for name in unfinished(where):
            remove(os.path.join(where, name))
        if odd := foreign(where):     # left alone: not ours to remove, never read or written through
            _say_once("foreign", f"{', '.join(map(repr, odd[:4]))}{' ...' if len(odd) > 4 else ''} in {where}: "
                                 f"not snapshot files (a symlink, a directory, or a step past {MAX_STEP}): ignored")
    below: int | None = None      # only steps older than this one are still candidates
    behind = False                # (with `lend`) this rank's newest step is older than most replicas' (until a refusal)
    while True:
        held = [s for s in steps(where) if below is None or s < below] if where is not None and not behind else []
        step = reduce_min(held[-1] if held else -1 if lend is None else NONE_HELD)
        if step < 0 or step == NONE_HELD:
            forget_after(-1, where)      # the job goes back to disk: these steps are not its future
            return None
        has = where is not None and os.path.exists(path(step, where))
        if lend is not None and reduce_sum is not None:
            newer = bool(held) and held[-1] > step
            at = bool(held) and held[-1] == step    # a fetched copy's step is no rank's own: behind (fetched.py)
            counts = reduce_sum((1 << 42) * (newer and has) + (1 << 21) * (newer and not has) +
                                (at and not is_copy(where, step)))
            holding, lacking, at_it = counts >> 42, (counts >> 21) & _FIELD, counts & _FIELD
            if lacking and lacking >= at_it or holding + lacking > at_it:     # (counts up to 2^21 ranks each)
                behind = behind or at
                continue
        ok = (has and (accept is None or accept(step))) or (lend is not None and not has)
        if reduce_min(1 if ok else 0) == 1:
            if lend is not None and not lend(step, has):
                forget_after(-1, where)
                return None
            forget_after(step, where)
            heartbeat.resumed(step)       # the agent's probe: steps redone after this restore
            return step
        below, behind = step, False       # a refusal: every rank's older steps are candidates again


def _await_copy(where: str) -> None:
    """While the agent brings this rank's snapshot from a peer (a node taking a lost node's place: its workers start
    meanwhile), FETCHING is in the directory; the agent removes it when the copy is in or failed. Polled: nothing
    else tells one process of another's file; bounded, so a worker never waits for ever."""
    mark = os.path.join(where, FETCHING)
    deadline = time.monotonic() + COPY_WAIT_S
    while os.path.exists(mark) and time.monotonic() < deadline:
        time.sleep(0.01)


def unfinished(where: str) -> list[str]:
    """The `step-N.tmp` files in `where`: a write under way (workers/writes.py lets it end before a stop), or a dead
    writer's (a worker killed mid-save), which agreed_step removes: nothing else ever would."""
    try:
        return [name for name, ours in _entries(where, ".tmp") if ours and _NAME.fullmatch(name[:-4])]
    except OSError:
        return []


def forget_after(step: int, where: str | None) -> list[int]:
    """Remove this rank's snapshots newer than the step the job resumes from: they belong to a run of steps the
    job abandoned, and `save` keeps the newest, so they would outlive the new ones (and be copied to peers).
    The agent does it too, before the workers start, when the server says replicas diverged after `step`.
    Returns the steps removed."""
    later = [s for s in steps(where) if s > step] if where is not None else []
    for s in later:
        remove(path(s, where))
    return later


def save(data: bytes | Writer, step: int, *, where: str | None = None, keep: int = 2,
         max_bytes: int | None = None) -> str:
    """Write the snapshot of `step` atomically; return its path. Raises MemoryDirFull (see above)."""
    if step < 0 or keep < 1:
        raise ValueError(f"step must be >= 0 and keep >= 1, got step={step}, keep={keep}")
    where = where or directory()
    if where is None:
        raise FileNotFoundError(f"no memory directory (${DIR_VAR} is not set)")
    bound = max_bytes if max_bytes is not None else limit()
    made = make_room(step, where, keep)
    held = [s for s in steps(where) if s != step]
    # A writer's size is known once written: taken to be the newest snapshot's (a state keeps its size)
    new = len(data) if isinstance(data, bytes | bytearray) else size(path(held[-1], where)) if held else 0
    fitted = fit(made, step, where, new, bound)     # no room beside after all (ENOSPC): MemoryDirFull, last kept
    return _written(data, step, where, bound, fitted, fewer(made, fitted, bound, new, keep))


def fewer(made: Room, room: Room, bound: int | None, new: int, keep: int) -> tuple[str, str] | None:
    """What a save says, once, where the limit (`room`, fitted from `made`) holds fewer snapshots than `keep`:
    (its kind, its line), or None."""
    if bound is None or room.kept_count + 1 >= keep or not (room.after or len(room.dropped) > len(made.dropped)):
        return None
    head = (f"the memory directory's limit ({bound} bytes) holds {room.kept_count + 1} snapshot(s) of {new} bytes, "
            f"not keep={keep}")
    if room.after:
        return "fewer", (f"{head}: the newest complete one stays beside the next until it is complete, past the "
                         f"limit, while /dev/shm and the memory have room for both; ranks that finish their writes "
                         f"at different times may hold no step in common meanwhile (room for {keep} leaves that to "
                         f"writes longer than a snapshot's interval: a larger --memory-dir-limit)")
    return "bare", (f"{head}, and there is no room beside it: the last one makes room before the next is written, "
                    f"so a node killed meanwhile leaves this rank none (room for {keep} keeps it: a larger "
                    f"--memory-dir-limit or /dev/shm)")


_said: set[str] = set()


def _say_once(kind: str, text: str) -> None:
    if kind not in _said:
        _said.add(kind)
        print(f"node-agent snapshot (rank {os.environ.get('RANK', '?')}): {text}", file=sys.stderr, flush=True)


def _written(data: bytes | Writer, step: int, where: str, bound: int | None, made: Room,
             said: tuple[str, str] | None) -> str:
    if said is not None:
        _say_once(*said)
    room = None if bound is None else bound - made.kept
    if room is not None and isinstance(data, bytes | bytearray) and len(data) > room:
        raise full_error(step, where, bound, made)        # known before a file goes
    for old in made.dropped:
        remove(path(old, where))
    final = path(step, where)
    tmp = final + ".tmp"
    out: Bounded | None = None
    try:
        remove(tmp)
        with open(tmp, "xb") as f:     # a new file (O_EXCL): never written through a symlink of its name
            out = Bounded(f, room)
            if isinstance(data, bytes | bytearray):
                out.write(data)
            else:
                data(out)   # type: ignore[arg-type]  # file-like: what writers such as torch.save take
        if out.full:   # the writer swallowed the refusal
            raise MemoryDirFull("full")
    except Exception as exc:
        remove(tmp)
        full = (out is not None and out.full) or isinstance(exc, MemoryDirFull)
        if full or (isinstance(exc, OSError) and exc.errno in FULL):   # or /dev/shm itself is full
            raise full_error(step, where, bound, made) from exc
        raise
    os.replace(tmp, final)
    for old in made.after:     # kept for the write's time only: at rest the limit holds
        remove(path(old, where))
    hold_after(step, where)
    return final


def hold_after(step: int, where: str, written: Callable[[], object] = lambda: None) -> None:
    """After the snapshot of `step` (`written` waits until its file is complete): while the agent asks for a hold
    (HOLD in the directory), say so (the probe) and wait until it goes, at most HOLD_MAX_S. The ranks that did not
    see it yet block in the next step's collectives, so no rank gets past `step`. Polled, as FETCHING is."""
    mark = os.path.join(where, HOLD)
    if not os.path.exists(mark):
        return
    written()
    heartbeat.held(step)
    deadline = time.monotonic() + HOLD_MAX_S
    while os.path.exists(mark) and time.monotonic() < deadline:
        time.sleep(HOLD_LOOK_S)
    if os.path.exists(mark):
        print(f"node-agent: held after the snapshot of step {step} for {HOLD_MAX_S:g}s and no swap came: training "
              f"goes on", flush=True)


@dataclass(frozen=True)
class Room:
    """What the keep rule does before `step` is written: all but the newest `keep - 1` go (so the last complete
    snapshot survives a failed write), but for those the agent's floors keep (KEEP_FROM: `floors`); the kept
    ones' bytes count against
    the limit (`fit`: it wins). `after`: the newest complete one, where nothing else would be kept, not counted
    against the limit: it stays past it until the new one is complete, so a rank killed during the write still
    holds one (kept at rest, a review found it got a worker OOM-killed at the training's next peak)."""
    dropped: list[int]
    kept: int           # bytes
    kept_count: int
    after: tuple[int, ...] = ()


def make_room(step: int, where: str, keep: int) -> Room:
    held = [s for s in steps(where) if s != step]
    older, (floor, slower) = held[:max(0, len(held) - (keep - 1))], floors(where)      # what the keep rule lets go
    dropped = [s for s in older if floor is None or s < floor]
    if slower is not None:      # for a slower rank: ranks step together, its newest is one older at most...
        dropped = [s for s in dropped if s != slower and (s != older[-1] or s < slower)]   # ...or its write failed
    if len(dropped) < len(older) and not headroom.room_beside(where, size(path(held[-1], where)), 0):
        dropped = older       # kept for a floor only where a reserve of memory stays (headroom.py), said once
        _say_once("floor", f"keeps no more snapshots than keep={keep} for the job's slower ranks or peer copies: "
                           f"/dev/shm or the memory has too little room left, and a failure while a slower rank "
                           f"still writes may find no step every rank holds")
    kept = [s for s in held if s not in dropped]
    return Room(dropped, sum(size(path(s, where)) for s in kept), len(kept))


def keep_from(where: str) -> int | None:
    """The step the agent asks this rank to keep its snapshots from (KEEP_FROM), or None."""
    return floors(where)[0]


def floors(where: str) -> tuple[int | None, int | None]:
    """KEEP_FROM's steps, None where not given: the copies floor (every snapshot from it on kept) and the held floor
    (the slowest rank's newest, as the server last heard: that step, and the newest snapshot the keep rule lets go
    if no older, are kept)."""
    try:
        with open(os.path.join(where, KEEP_FROM)) as f:
            given = [int(n) for n in f.read(64).split()[:2]]
    except (OSError, ValueError):
        return None, None
    copies, held = (given + [-1, -1])[:2]
    return (copies if copies >= 0 else None), (held if held >= 0 else None)


def fit(room: Room, step: int, where: str, new: int, bound: int | None, own: Collection[int] = ()) -> Room:
    """`room`, with the oldest kept snapshots dropped too until `new` more bytes fit `bound`: a limit that holds
    fewer snapshots than `keep` keeps the newest (kept refused, the oldest would outlive every later step and be
    what the job resumes from). Unchanged where the new one alone does not fit. Where nothing would be kept, the
    newest complete snapshot stays beside the new one (`after`), if there is room for both: within `bound`, else
    in the file system and the memory, less what the drops give back (headroom.py); else a node killed during the
    write would leave the rank none."""
    if bound is not None and new > bound:
        return room
    dropped, kept, count = list(room.dropped), room.kept, room.kept_count
    if bound is not None:
        for old in [s for s in steps(where) if s != step and s not in room.dropped]:
            if kept + new <= bound:
                break
            dropped.append(old)
            kept -= size(path(old, where))
            count -= 1
    complete = [s for s in steps(where) if s != step]
    if count == 0 and complete:
        last = complete[-1]
        freed = headroom.freed_by([path(s, where) for s in dropped if s != last], own)
        if (bound is not None and kept + size(path(last, where)) + new <= bound) or \
                headroom.room_beside(where, new, freed):
            return Room([s for s in dropped if s != last], kept, 0, (last,))
    return Room(dropped, kept, count)


def full_error(step: int, where: str, bound: int | None, room: Room) -> MemoryDirFull:
    left = None if bound is None else bound - room.kept
    need = "found /dev/shm full" if left is None else f"needs more than the {left} bytes left" if left > 0 else \
        "finds it taken by those (a smaller limit than they were kept under)"
    return MemoryDirFull(f"snapshot of step {step} does not fit the memory directory {where}: limit {_text(bound)}, "
                         f"{room.kept} bytes kept in {room.kept_count} older snapshot(s), the new one {need}")


def _text(bound: int | None) -> str:
    return "none" if bound is None else f"{bound} bytes ({bound / 2**20:.1f} MiB)"


def size(p: str) -> int:
    """Bytes of `p`; 0 once it is gone."""
    try:
        return os.path.getsize(p)
    except OSError:
        return 0


def remove(p: str) -> None:
    """Unlink `p`; gone already is fine."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(p)
