"""The node's in-memory checkpoint directories: made before the first workers start, kept across their
restarts (one per local rank), removed when the agent ends; node_agent/training/snapshot.py is the worker's side.
Layout: BASE/node-agent-mem-UID/JOB.NODE.HASH/LOCAL_RANK, BASE being /dev/shm (memory that outlives the
workers), else the temp directory (a disk: warned). --memory-dir-limit is shared equally by the local ranks.
The memory belongs to the job and the node id, not to one agent process (workers/owners.py says who owns it):
- An agent killed (SIGKILL, an OOM kill) cannot clean up. The next agent under the same job and node id takes its
  directory up (systemd's Restart=, a container restarted): its snapshots stay, if its first round is of the same
  run of the job (Assignment.run; another run's are removed) and for the local ranks whose global ranks are
  the same (dirs_for).
- An agent started without --node-id takes the node id of an ended agent of the same job on this host whose id was
  made from its pid (HOSTNAME-PID, the default), and its directory with it (workers/succession.py): a torchrun
  user's restarted agent keeps its node's place and memory as one given an id does.
- Every agent starting removes the directories of agents that are gone, but a node's that its next agent may take
  up (its id given, or taken by a successor: an agent that reached a server) written to within KEEP_S (its next
  agent is minutes away at most: a restart policy's back-off); a live agent marks its directory written to every
  ALIVE_EVERY_S (`alive`). So memory no agent comes back for is held KEEP_S past its agent's end, no longer; a
  standalone run's without --node-id goes at once.
- An agent stopped by a signal while the job keeps its place (`systemctl restart`: NodeStatus.place_kept_s) leaves
  its directory as a killed one does (close(keep=WHY)).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable

import node_agent.training.snapshot as snapshot
from node_agent.settings import default_node_id, made_from_pid
from node_agent.workers import owners
from node_agent.workers.memory_files import bytes_under, default_limit, empty

SHM = "/dev/shm"
RANK_FILE = ".rank"      # in each local rank's directory: the global rank whose snapshots it holds
IDENTITY = "identity"    # in the node's directory: its job id and node id, a line each, and SUCCEEDED where so
SUCCEEDED = "succeeded"  # its node id made from its agent's pid is taken by the next agent (workers/succession.py)
RUN = "run"              # in the node's directory: the run of the job its snapshots are of (Assignment.run)
COPIES = "replicas"      # in the node's directory: the copies it holds for other nodes (node_agent/copies/peers.py)
ALIVE_EVERY_S = 60.0     # how often a live agent marks its node's directory written to (MemoryDirs.alive)
KEEP_S = 600.0           # an ended agent's memory is kept this long after its last write, for its node's next agent


def parent_dir(base: str | None) -> str:
    """Where this user's node directories lie: under `base`, else /dev/shm where it can be written, else the temp
    directory (a disk)."""
    if base is None:
        base = SHM if os.path.isdir(SHM) and os.access(SHM, os.W_OK) else tempfile.gettempdir()
    return os.path.join(base, f"node-agent-mem-{os.getuid()}")


def unsafe_parent(parent: str) -> str:
    """Why `parent` may not hold this user's memory ("": it may, or is not there yet): not a directory of this uid that
    no one else may write to (ours: tightened to 0o700). Another local user may make the name first in the sticky
    /dev/shm, then read the snapshots and the agent's secret, or plant files and symlinks where it writes them."""
    try:
        st = os.lstat(parent)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
            if st.st_mode & 0o077:
                os.chmod(parent, 0o700)
            return ""
    except OSError as exc:
        return "" if isinstance(exc, FileNotFoundError) else f"{parent}: {exc.strerror or exc}"
    kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode) else "a file"
    return (f"{parent} is {kind} of uid {st.st_uid}, not this agent's own (uid {os.getuid()}) directory: another "
            f"user may read or replace what it holds; remove it, or run with --no-memory-dir")


def dir_name(job_id: str, node_id: str) -> str:
    """The node's directory's name: readable, one path component, and the same for the same job and node id."""
    def slug(text: str) -> str:
        return re.sub(r"[^A-Za-z0-9_.:@+=~-]", "_", text)[:96]
    digest = hashlib.sha256(f"{job_id}\0{node_id}".encode()).hexdigest()[:12]
    return f"{slug(job_id)}.{slug(node_id) or 'agent'}.{digest}"


class MemoryDirs:
    def __init__(self, job_id: str, nproc: int, limit: int | None, *, say: Callable[[str], None],
                 base: str | None = None, node_id: str = "") -> None:
        """`node_id` "": this agent's default, HOSTNAME-PID."""
        self.job_id = job_id
        self.node_id = node_id or default_node_id()
        self.nproc = nproc
        self.limit = limit          # bytes for the whole node; None: the default; 0: off
        self.say = say
        # A next agent started without --node-id takes this node's id and directory where its id is made from this
        # agent's pid: set by an agent that reaches a server (a standalone run's job id is new each time)
        self.succeeded = False
        self._base = base
        self.root: str | None = None   # this node's directory, once made
        self.rank_limit: int | None = None
        self._owner: owners.Ownership | None = None
        self._inherited: int | None = None   # the pid of the ended agent whose directory this one took up
        self._failed = False
        self._keep_failed = False     # a keep-from mark that could not be written: said once
        self._alive_at = 0.0          # when the directory was last marked as its live agent's (time.monotonic())
        self._opening = threading.Lock()    # one open at a time: the agent's runs in a thread (succession.opened)

    @property
    def enabled(self) -> bool:
        return self.limit != 0 and not self._failed

    def usable(self) -> bool:
        """`enabled`, its parent directory this user's own (`unsafe_parent`): else memory is off, said once."""
        if self.enabled and self.root is None and (why := unsafe_parent(parent_dir(self._base))):
            self._failed = True
            self.say(f"no in-memory checkpoint directory ({why}); workers run without one")
        return self.enabled

    def dirs(self, local_world_size: int) -> dict[int, str]:
        """local rank -> its directory, made on the first call (empty when switched off or impossible)."""
        if not self.enabled:
            return {}
        try:
            with self._opening:
                root = self.root or self._open()
            out = {rank: os.path.join(root, str(rank)) for rank in range(local_world_size)}
            for path in out.values():
                os.makedirs(path, mode=0o700, exist_ok=True)
            return out
        except OSError as exc:   # never a failed job over it: the workers run without
            self._failed = True
            self.close()
            self.say(f"no in-memory checkpoint directory ({exc.strerror or exc}); workers run without one")
            return {}

    def moved_to(self, home: str) -> None:
        """Its directory, still owned by this agent, was renamed `home` (succession.settle)."""
        self.root = home
        if self._owner is not None:
            self._owner.directory = home
        self._identify(home)

    def _identify(self, where: str) -> None:
        """The directory's job and node id, for the sweep and the node's next agent (IDENTITY)."""
        mark = SUCCEEDED if self.succeeded else ""
        _write(os.path.join(where, IDENTITY), f"{self.job_id}\n{self.node_id}\n{mark}\n")

    @property
    def home(self) -> str:
        """This node's own directory (the job's and the node id's), whether made yet or not."""
        return os.path.join(parent_dir(self._base), dir_name(self.job_id, self.node_id))

    def hold(self, on: bool) -> None:
        """Ask this node's ranks to wait after their next snapshot (snapshot.HOLD, NodeStatus.hold_at_snapshot), or
        no longer. A directory that cannot take the mark is said: its ranks then step on (the others wait)."""
        for path in (self.dirs(self.nproc) if self.root is not None else {}).values():
            mark = os.path.join(path, snapshot.HOLD)
            try:
                if on:
                    with open(mark, "w"):
                        pass
                else:
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(mark)
            except OSError as exc:
                self.say(f"cannot {'set' if on else 'clear'} the hold at the next snapshot in {path}: {exc}")

    def keep_from(self, step: int, held: int = -1) -> None:
        """Ask this node's ranks to keep their snapshots from `step` on (snapshot.KEEP_FROM; -1: no longer), and the
        newest their keep rule lets go where it is of `held` or later (-1: none). A directory that cannot take the
        mark is said once: its ranks keep only what their keep rule keeps."""
        for path in (self.dirs(self.nproc) if self.root is not None else {}).values():
            mark = os.path.join(path, snapshot.KEEP_FROM)
            try:
                if step >= 0 or held >= 0:   # renamed into place: a rank reading it sees the old steps or the new
                    _write(mark + ".new", f"{step} {held}")
                    os.replace(mark + ".new", mark)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(mark)
            except OSError as exc:
                if not self._keep_failed:
                    self._keep_failed = True
                    self.say(f"cannot ask the ranks in {path} to keep their snapshots from step {step} on: {exc}")

    def dirs_for(self, local_world_size: int, rank_offset: int, run: str = "", alike: bool = False) -> dict[int, str]:
        """`dirs`, for the round of run `run` whose local rank 0 is global rank `rank_offset`: a directory of another
        global rank's snapshots (ranks moved: it closed up, or took a gone node's place) is emptied, a shard never
        loaded by another rank; not where ranks are replicas (`alike`: DDP's digests agreed: a review saw a last
        survivor, moved, remove the only snapshot left: step 0). Taken up from an ended agent: for the same run."""
        if self.dirs(local_world_size) and self.root is not None:
            self._take_up(run, local_world_size)
        out = self.dirs(local_world_size)
        moved = []
        for local, path in out.items():
            mark = os.path.join(path, RANK_FILE)
            try:
                with open(mark) as f:
                    held = f.read().strip()
            except OSError:
                held = ""
            if held and held != str(rank_offset + local):
                moved.append(held)
                if not alike:
                    empty(path, keep={RANK_FILE})
            with contextlib.suppress(OSError), open(mark, "w") as f:
                f.write(f"{rank_offset + local}\n")
        if moved:
            self.say(f"this node's ranks moved (now from {rank_offset}): the snapshots of rank(s) {', '.join(moved)} " +
                     ("are kept, the job's ranks being replicas (their digests agreed)" if alike else
                      "are not theirs and were removed"))
        return out

    def _take_up(self, run: str, local_world_size: int) -> None:
        """On the first round after taking up an ended agent's directory: keep it for the same run, else empty it;
        then note the run, and drop the directories of local ranks this node no longer has."""
        assert self.root is not None
        path = os.path.join(self.root, RUN)
        if self._inherited is not None:
            before, self._inherited = self._inherited, None
            if run and read_text(path) == run:
                self.say(f"kept the memory of node {self.node_id}'s previous agent (pid {before}, ended): its "
                          f"snapshots, and the copies it held for others, stay this node's")
                _unpin(self.root)          # its sends ended with it: their files may be written over, or go
            else:
                empty(self.root, keep={owners.OWNER, IDENTITY})
                self.say(f"removed the memory node {self.node_id}'s previous agent (pid {before}) left: it is of "
                          f"another run of job {self.job_id!r}")
        if read_text(path) != run:
            _write(path, run)
        gone = sorted((n for n in os.listdir(self.root) if n.isdigit() and int(n) >= local_world_size), key=int)
        for name in gone:
            shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        if gone:
            self.say(f"this node now runs {local_world_size} local rank(s): the snapshots of local rank(s) "
                      f"{', '.join(gone)} were removed")

    def _open(self) -> str:
        parent = parent_dir(self._base)
        base = os.path.dirname(parent)
        if self._base is None and base != SHM:
            self.say(f"no writable {SHM}: the in-memory checkpoint directory is on disk, under {base}")
        with contextlib.suppress(FileExistsError):
            os.makedirs(parent, mode=0o700)
        if why := unsafe_parent(parent):
            raise OSError(why)
        name = dir_name(self.job_id, self.node_id)
        removed = sweep(parent, besides=name)
        if removed:
            self.say(f"removed {removed} in-memory checkpoint director{'y' if removed == 1 else 'ies'} "
                      f"left by agents that were killed")
        self._owner = own = self._claim(parent, name)
        limit = self.limit if self.limit is not None else \
            default_limit(base, bytes_under(own.directory) if own.previous is not None else 0)
        self.root = own.directory
        self.rank_limit = limit // max(1, self.nproc)
        self._inherited = own.previous
        if own.previous is not None:
            self.say(f"found node {self.node_id}'s memory, left by its previous agent (pid {own.previous}, ended): "
                      f"taken up, if this round is of the same run")
        share = f"{self.rank_limit / 2**20:.{0 if self.rank_limit >= 10 * 2**20 else 1}f} MiB" \
            if self.rank_limit >= 2**20 else f"{self.rank_limit} bytes"      # (1.5 MiB is not "2 MiB")
        self.say(f"in-memory checkpoints: {self.root}/LOCAL_RANK, {share} per local rank ($NODE_AGENT_MEMORY_DIR)")
        return self.root

    def _claim(self, parent: str, name: str) -> owners.Ownership:
        """The node's directory, owned by this agent: made, or taken up from an ended agent. While a live agent owns
        it (the same job and node id twice on this host) this one makes a directory of its own."""
        where = os.path.join(parent, name)
        for _ in range(3):
            with contextlib.suppress(FileExistsError):
                os.mkdir(where, 0o700)
            own = owners.claimed_ahead.pop(where, None) or owners.claim(where)
            if own is not None:
                self._identify(where)
                return own
            if os.path.isdir(where):
                break
        alone = tempfile.mkdtemp(prefix=f"{name}.{os.getpid()}.", dir=parent)
        own = owners.claim(alone)
        if own is None:
            raise OSError(f"cannot own {alone}")
        self.say(f"another live agent of node {self.node_id} keeps its memory in {where}: this one uses {alone}")
        return own

    def alive(self) -> None:
        """Mark the directory written to now, at most every ALIVE_EVERY_S: KEEP_S counts from when its agent was last
        alive, not from its last snapshot (a review: with snapshots ten minutes apart, the next agent of a killed one
        found its memory too old to take up, made a new node and swept the memory: every rank from step 0)."""
        now = time.monotonic()
        if self.root is None or now - self._alive_at < ALIVE_EVERY_S:
            return
        self._alive_at = now
        with contextlib.suppress(OSError):
            os.utime(os.path.join(self.root, IDENTITY))

    def close(self, keep: str = "") -> None:
        """Remove this node's directories (the job ended, or the node leaves); `keep`: why they stay for its next
        agent instead (a stopped agent: `systemctl restart`), which takes them up as a killed agent's, where it can
        (by its node id: given, or taken from this one: workers/succession.py)."""
        if keep and self.root is not None and os.path.basename(self.root) == dir_name(self.job_id, self.node_id):
            self.say(f"{keep}: its snapshots stay in {self.root} for it (else removed by "
                      f"the next agent starting on this host, {KEEP_S:.0f}s after their last write)")
        elif self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
        self.root = None
        if self._owner is not None:
            self._owner.release()
            self._owner = None


def left_behind(job_id: str, node_id: str, base: str | None = None) -> tuple[str, int] | None:
    """This node's directory and the newest snapshot in it, where an ended agent of the node left one, else None."""
    if unsafe_parent(parent_dir(base)):
        return None
    home = os.path.join(parent_dir(base), dir_name(job_id, node_id))
    held: list[int] = []
    for rank in (name for name in listdir(home) if name.isdigit()):
        with contextlib.suppress(OSError):
            held += snapshot.steps(os.path.join(home, rank))
    return (home, max(held)) if held else None


def sweep(parent: str, besides: str = "") -> int:
    """Remove the directories under `parent` whose owning agent is gone (not one being made, nor `besides`), but
    those its node's next agent may take up (written within KEEP_S). How many went."""
    removed = 0
    now = time.time()
    for entry in os.scandir(parent):
        if entry.name == besides:
            continue
        gone = owners.owner_gone(entry.path)
        if gone is None:
            continue     # alive, being made, or not ours
        try:
            _, node, mark = identity(entry.path)
            comes_back = node and (mark == SUCCEEDED or not made_from_pid(node))   # (none: nobody's to take up)
            if comes_back and now - last_write(entry.path) < KEEP_S:
                continue
            shutil.rmtree(entry.path, ignore_errors=True)
            removed += 1
        finally:
            gone.release()
    return removed


def scandir(path: str) -> list[os.DirEntry[str]]:
    try:
        return [e for e in os.scandir(path) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def last_write(root: str) -> float:
    """When a node's directory was last written to: its owner file, its ranks' snapshots."""
    times = [0.0]
    for where in (root, *(os.path.join(root, n) for n in listdir(root) if n.isdigit())):
        for name in listdir(where):
            with contextlib.suppress(OSError):
                times.append(os.stat(os.path.join(where, name), follow_symlinks=False).st_mtime)
    return max(times)


def listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(4096).strip()
    except OSError:
        return ""


def _unpin(root: str) -> None:
    """Remove the second names an ended agent gave the snapshots it was sending (snapshot.SENDING)."""
    for rank in listdir(root):
        where = os.path.join(root, rank)
        for name in listdir(where) if rank.isdigit() else ():
            if name.startswith(snapshot.SENDING):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(where, name))


def identity(directory: str) -> tuple[str, str, str]:
    """A node directory's job id, node id and mark (SUCCEEDED or ""), as `_claim` wrote them ("" where missing)."""
    job_id, node_id, mark, *_ = (read_text(os.path.join(directory, IDENTITY)) + "\n\n\n").split("\n")
    return job_id, node_id, mark


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def forget_after(step: int, dirs: dict[int, str]) -> list[int]:
    """Remove the snapshots newer than `step` from these ranks' directories (the server says the replicas
    diverged after it: Assignment.resume_at_most); the steps removed, for the agent to say."""
    return sorted({s for where in dirs.values() for s in snapshot.forget_after(step, where)})
