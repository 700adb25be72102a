"""How a node's next agent succeeds its previous one on a host (an OOM kill, systemd's Restart=, a container
restarted, an agent stopped and started again): the node's memory directory (workers/memory.py) carries what it
needs.
- Its node id: an agent started without --node-id (HOSTNAME-PID, a torchrun user's) takes the id of an ended agent of
  its job on this host whose id was made from its pid, and its directory with it (`predecessor`).
- Its place: each agent keeps the secret the server gave it in the directory (`keep_credential`); the next one
  shows it (JoinRequest.predecessor, `left_credential`) and takes the node's record at once where it still looks
  alive. Only an ended agent's secret is read: a second live agent given the same node id never takes the first's.
- Its memory: where the previous agent still owns the directory while it stops its workers (it left; the server took
  this one in its place), the next one waits for it to end (`predecessor_gone`) rather than start without it."""
from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time

from node_agent.settings import made_from_pid
from node_agent.workers import memory, owners
from node_agent.workers.memory import MemoryDirs
from protocol.bounds import MAX_CREDENTIAL

SECRET = "credential"    # in the node's directory: its agent's secret from the server, for its next agent to show
WAITING = "credential-waiting"   # and a next agent's, with its pid, while it waits for its predecessor to end
_NEW = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW   # a secret's file: a symlink is refused


def predecessor(job_id: str, nproc: int, base: str | None = None) -> tuple[str, int] | None:
    """(node id, pid) of the ended agent whose memory this agent, started without --node-id, takes with its node id:
    one of `job_id` on this host whose id was made from its pid (HOSTNAME-PID), that ran `nproc` local ranks (a
    review: agents of 1 and 3 workers restarted together swapped ids, and every rank moved: step 0), written to
    within KEEP_S, the newest written where several are. Its directory is claimed here (two agents starting at once
    take one each, never the same). None where there is none: a new node id, as before."""
    found = []
    now = time.time()
    if memory.unsafe_parent(memory.parent_dir(base)):
        return None          # another user's, or a symlink: nothing read from it (MemoryDirs says so, once)
    for entry in memory.scandir(memory.parent_dir(base)):
        its_job, node_id, mark = memory.identity(entry.path)
        if its_job != job_id or not made_from_pid(node_id) or mark != memory.SUCCEEDED or \
                entry.name != memory.dir_name(job_id, node_id):
            continue
        ranks = sum(1 for name in memory.listdir(entry.path) if name.isdigit())
        written = memory.last_write(entry.path)
        if ranks == nproc and now - written < memory.KEEP_S:
            found.append((written, entry.path, node_id))
    for _, path, node_id in sorted(found, reverse=True):
        gone = owners.owner_gone(path)       # an ended agent's (not a live one's, nor one being made)
        if gone is None:
            continue
        gone.release()
        own = owners.claim(path)
        if own is not None and own.previous is not None:
            owners.claimed_ahead[path] = own
            return node_id, own.previous
        if own is not None:
            own.release()
    return None


def keep_credential(dirs: MemoryDirs, secret: str) -> None:
    """Keep the agent's secret from the server in the node's directory, once open (not where it cannot be written;
    open: its parent passed memory.unsafe_parent)."""
    if not secret or dirs.root is None or dirs.root != dirs.home:
        return
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(dirs.root, WAITING))      # this agent's, or older: SECRET is the newest now
    path = os.path.join(dirs.root, SECRET)
    if memory.read_text(path) == secret:
        return
    _write_secret(path, secret)


def left_credential(dirs: MemoryDirs) -> str:
    """The secret the node's previous agent kept in its directory, where that agent has ended; "" where none. A
    next agent that ended while it waited for its own predecessor (`predecessor_gone`) held the node's record last:
    its secret (WAITING) is the one the server knows, whether that predecessor still stops or not. Told apart
    by pid and start time (`owners.alive`), never the pid alone: a container's agent is pid 1 after each restart."""
    if not dirs.usable():    # another user's directory: what it holds may be theirs (memory.unsafe_parent)
        return ""
    where = dirs.home
    who, _, waiting = memory.read_text(os.path.join(where, WAITING)).partition("\n")
    pid, _, started = who.partition(" ")
    if pid.isdigit() and not owners.alive(int(pid), started) and \
            0 < len(waiting) <= MAX_CREDENTIAL:
        return waiting
    claimed = where in owners.claimed_ahead          # taken with its node id (`predecessor`)
    gone = None if claimed else owners.owner_gone(where)
    if not claimed and gone is None:
        return ""
    secret = memory.read_text(os.path.join(where, SECRET))
    if gone is not None:
        gone.release()
    return secret if len(secret) <= MAX_CREDENTIAL else ""


async def predecessor_gone(dirs: MemoryDirs, limit_s: float, secret: str = "") -> None:
    """Before the node's directory is first opened: while a live agent still owns it, wait for it to end, up to
    `limit_s` (a review: the next agent made a directory of its own, and fetched its copies, a snapshot behind).
    Meanwhile this agent's `secret` is kept beside the predecessor's (WAITING): a review killed it as it waited
    (two restarts in quick succession), and the agent after it, showing the older secret, was refused until its
    lease ran out; the node was taken for lost, the elastic job went on without it and excluded it as flapping."""
    if dirs.root is not None or not dirs.usable():
        return
    where = dirs.home
    deadline = time.monotonic() + limit_s
    said = False
    while where not in owners.claimed_ahead and (pid := owners.live_owner(where)) is not None \
            and time.monotonic() < deadline:
        if not said:
            said = True
            _keep_waiting(where, secret)
            dirs.say(f"node {dirs.node_id}'s previous agent (pid {pid}) still owns its memory, stopping its workers: "
                     f"waiting up to {limit_s:g}s for it to end, so this node keeps its snapshots")
        await asyncio.sleep(0.1)


async def opened(dirs: MemoryDirs) -> None:
    """Open the node's directory (MemoryDirs.dirs) in a thread: its claim may wait out another agent's sweep, up to
    owners.SWEEP_WAIT_S, and the agent's loop (heartbeats, long-polls, the copy port) must not stall meanwhile."""
    if dirs.root is None and dirs.enabled:
        await asyncio.to_thread(dirs.dirs, 0)


def _keep_waiting(where: str, secret: str) -> None:
    """This agent's secret and who it is (pid, start time), renamed into the predecessor's directory."""
    if not secret:
        return
    path = os.path.join(where, WAITING)
    _write_secret(path, f"{os.getpid()} {owners.start_time(os.getpid()) or ''}\n{secret}")


def settle(dirs: MemoryDirs) -> None:
    """A directory of its own, made while the node's was a live predecessor's (it never ended within the wait): moved
    to the node's own name once no live agent holds that (between rounds: no worker writes it), so the agent after
    this one takes it up. A review: it stayed apart, and the agent after it swept it as a killed agent's and fetched
    the copies, a snapshot behind. What is left under the node's name is an ended predecessor's, older."""
    root, home = dirs.root, dirs.home
    if root is None or root == home or owners.live_owner(home) is not None:
        return
    shutil.rmtree(home, ignore_errors=True)
    try:
        os.rename(root, home)
    except OSError:
        return
    dirs.moved_to(home)
    dirs.say(f"node {dirs.node_id}'s previous agent has ended: this one's memory moved to {home}, where the node's "
             f"next agent finds it")


def _write_secret(path: str, text: str) -> None:
    """`text` into `path` whole (written aside, renamed), readable by this user only, never through a symlink; a
    failed write leaves what was there (the agent goes on without keeping it)."""
    with contextlib.suppress(OSError):
        fd = os.open(path + ".new", _NEW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(path + ".new", path)
