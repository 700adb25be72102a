"""The holder's files (store.py): ROOT/NODE/RANK/step-S with its checksum step-S.sha256, and which of a node's
copies to keep. Plain file operations, no networking."""
from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass

from node_agent.copies import stream, wire
from node_agent.training.snapshot import SENDING, remove, size
from protocol.tokens import copy_verifier

STEP_FILE = re.compile(r"step-(\d{1,18})")
OURS = re.compile(r"step-(\d{1,18})(\.sha256|\.tmp)?")
RANK_DIR = re.compile(r"0|[1-9][0-9]{0,3}")


@dataclass(frozen=True)
class Copy:
    """A complete copy held: whose (node, rank), of which step, its bytes, the round it was pushed in."""
    node: str
    rank: int
    step: int
    size: int
    round: int


def rank_dir(root: str, node: str, rank: int) -> str:
    return os.path.join(root, node, str(rank))


def copies(root: str) -> list[Copy]:
    """Every complete copy under `root` (a crash may leave two of one (node, rank): both count as bytes)."""
    found: list[Copy] = []
    for node in listdir(root):
        if not wire.valid_node(node):
            continue
        for rank in listdir(os.path.join(root, node)):
            if RANK_DIR.fullmatch(rank) is None or int(rank) > wire.MAX_RANK:
                continue
            where = rank_dir(root, node, int(rank))
            for step in complete_steps(where):
                path = os.path.join(where, f"step-{step}")
                held = read_sum(path + ".sha256")
                found.append(Copy(node, int(rank), step, size(path), held[1] if held else 0))
    return found


def settle(node_dir: str, landed: str) -> None:
    """After a copy landed in `landed` (a rank's directory under `node_dir`): each rank keeps its newest copy, the
    newest step every rank of the node holds (their common step) and the common step before it (a spare: see
    spares), nothing else; and `landed` no leftover .tmp (its push slot is held). A node lost while its ranks'
    copies of a step were still landing leaves a step all of them have, for the node taking its place (agreed_step
    needs one step on every rank)."""
    ranks = [os.path.join(node_dir, r) for r in listdir(node_dir) if RANK_DIR.fullmatch(r)]
    held = {where: complete_steps(where) for where in ranks}
    common = sorted(set.intersection(*map(set, held.values()))) if held else []
    for where, steps in held.items():
        keep = {max(steps, default=None), *common[-2:]}
        for name in listdir(where):
            m = OURS.fullmatch(name)
            if m and (int(m.group(1)) not in keep if m.group(2) != ".tmp" else where == landed):
                remove(os.path.join(where, name))


def spares(found: list[Copy]) -> list[Copy]:
    """The copies kept only while room allows: neither their rank's newest nor their node's common step (settle
    keeps the common step before it). Two nodes lost together whose copies landed a snapshot apart (one holder had
    step 75, the other 70) share no step but through them: without, every rank resumed from step 0 (a review).
    Never counted against a push: the first to go when room is needed (store.py)."""
    newest: dict[tuple[str, int], int] = {}
    ranks: dict[str, dict[int, set[int]]] = {}
    for c in found:
        newest[(c.node, c.rank)] = max(c.step, newest.get((c.node, c.rank), -1))
        ranks.setdefault(c.node, {}).setdefault(c.rank, set()).add(c.step)
    common = {node: max(set.intersection(*held.values()), default=None) for node, held in ranks.items()}
    return [c for c in found if c.step != newest[(c.node, c.rank)] and c.step != common[c.node]]


def drop(where: str, step: int) -> None:
    """Remove a rank's copy of `step` (its checksum with it)."""
    remove(os.path.join(where, f"step-{step}"))
    remove(os.path.join(where, f"step-{step}.sha256"))


def complete_steps(where: str) -> list[int]:
    """The steps of the complete copies in a rank's directory (`step-S` with its `.sha256`)."""
    names = set(listdir(where))
    return [int(m.group(1)) for name in names if (m := STEP_FILE.fullmatch(name)) and name + ".sha256" in names]


_SUM = re.compile(r"([0-9a-f]{64})(?: round=(0|[1-9][0-9]{0,15}))?")


class CorruptAtRest(Exception):
    """A held copy whose checksum file is unreadable (`step`): it cannot be served."""
    def __init__(self, step: int) -> None:
        super().__init__(f"step {step}")
        self.step = step


def open_held(where: str, want: int | None = None, before: bool = False) -> tuple[int, int, str] | None:
    """(open fd, step, stored checksum) of the complete copy in a rank's directory (the newest, step `want`, or
    with `before` the newest below it, of the round `want` is of: a step of an older round may be of the line the
    job abandoned when it went back), or None. A push that lands meanwhile removes the older copy between looking
    and opening: look again."""
    for _ in range(3):
        held = complete_steps(where)
        step = max(held, default=None) if want is None else want if want in held and not before else \
            max((s for s in held if s < want), default=None) if before else None
        if step is None or before and (want not in held or (r := _round(where, step)) is not None and
                                       r != _round(where, want)):    # (unreadable: CorruptAtRest below)
            return None
        path = os.path.join(where, f"step-{step}")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        summed = read_sum(path + ".sha256")
        if summed is None:
            os.close(fd)
            if not os.path.exists(path + ".sha256"):
                continue
            raise CorruptAtRest(step)
        return fd, step, summed[0]
    return None


def _round(where: str, step: int) -> int | None:
    held = read_sum(os.path.join(where, f"step-{step}.sha256"))
    return held[1] if held else None


def write_sum(path: str, hex_digest: str, round_id: int) -> None:
    """A copy's checksum file: its sha256 and the round it was pushed in (its pusher's incarnation)."""
    write_text(path, f"{hex_digest} round={round_id}\n")


def read_sum(path: str) -> tuple[str, int] | None:
    """(sha256, round) of a copy's checksum file (round 0: written before rounds were), or None: unreadable."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            m = _SUM.fullmatch(f.read(wire.MAX_LINE).strip())
    except OSError:
        return None
    return (m.group(1), int(m.group(2) or 0)) if m else None


def space(path: str) -> tuple[int, int]:
    """(free, total) bytes of the file system `path` (or its nearest existing parent) is on; under /dev/shm no more
    than the host's memory available and its total (a review: /dev/shm sized past what the host has, a member's
    copy of 10 GiB was taken, and the kernel killed a process for memory)."""
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    st = os.statvfs(path)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    memory = ram() if os.path.realpath(path).startswith("/dev/shm") else None
    return (min(free, memory[0]), min(total, memory[1])) if memory is not None else (free, total)


def ram() -> tuple[int, int] | None:
    """(available, total) bytes of the host's memory, from /proc/meminfo; None where it cannot be read."""
    fields: dict[str, int] = {}
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("MemAvailable", "MemTotal"):
                fields[name] = int(rest.split()[0]) * 1024
    return (fields["MemAvailable"], fields["MemTotal"]) if len(fields) == 2 else None


def mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return 0.0


def open_new(root: str, node: str, rank: str, path: str) -> int:
    """Create `path` under ROOT/NODE/RANK, making each directory private (0o700) where it is missing."""
    os.makedirs(root, mode=0o700, exist_ok=True)
    for where in (os.path.join(root, node), os.path.join(root, node, rank)):
        with contextlib.suppress(FileExistsError):
            os.mkdir(where, 0o700)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)


def write_text(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        stream.write_all(fd, text.encode("ascii"))
    finally:
        os.close(fd)


def listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


VERIFIER = ".verifier"     # in a node's directory: the verifier of the key its copies came with
TOKEN = ".token"           # (an older agent's: the key itself)


def note_verifier(node_dir: str, verifier: str) -> None:
    if _read_short(os.path.join(node_dir, VERIFIER)) != verifier:
        write_text(os.path.join(node_dir, VERIFIER), verifier)
    remove(os.path.join(node_dir, TOKEN))       # an older agent's note of the key itself: no secret kept at rest


def read_verifier(node_dir: str) -> str:
    """What a key for the copies in `node_dir` is checked against ("": none noted)."""
    if held := _read_short(os.path.join(node_dir, VERIFIER)):
        return held
    return copy_verifier(_read_short(os.path.join(node_dir, TOKEN)))


def _read_short(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read(256).strip()
    except OSError:
        return ""


_MINE = f"{SENDING}{os.urandom(6).hex()}-"   # this process's pins (a restarted container's agent may have its pid)


def pin(path: str, opened: os.stat_result) -> str | None:
    """A second name for the snapshot at `path` (opened as `opened`) while its bytes are sent: a worker writes
    over no snapshot file with two names (training/capture.py), so a send slower than the snapshots come still
    lands. The name, or None where it cannot be made (the file gone or renamed away: the send notices). A pin
    another process left (a gone agent's) is removed first; a taken-up directory loses them all
    (workers/memory.py)."""
    where = os.path.dirname(path)
    for name in listdir(where):
        if name.startswith(SENDING) and not name.startswith(_MINE):
            remove(os.path.join(where, name))
    name = os.path.join(where, f"{_MINE}{os.urandom(6).hex()}")
    try:
        os.link(path, name)
        if os.stat(name).st_ino == opened.st_ino:
            return name
    except OSError:
        return None
    remove(name)
    return None


def names(path: str, fd: int, since: int) -> bool:
    """The bytes `fd` read are still the snapshot at `path`: it was not written to since its modification time
    was `since` (taken at the open), and either `path` still names it or no name in its directory does but pins
    (it was unlinked). A worker renames a snapshot file away and sets its modification time before it writes it
    over (training/capture.py): a file it died writing, unlinked after, is no longer the snapshot either."""
    try:
        held = os.fstat(fd)
    except OSError:
        return False
    if held.st_mtime_ns != since:
        return False
    if _inode(path) == held.st_ino:
        return True
    where = os.path.dirname(path)
    return not any(_inode(os.path.join(where, n)) == held.st_ino for n in listdir(where) if not n.startswith(SENDING))


def _inode(path: str) -> int:
    try:
        return os.stat(path).st_ino
    except OSError:
        return -1
