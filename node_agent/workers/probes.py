"""The agent's side of the progress probes (node_agent/training/probe.py): where each worker's record and stacks
go, reading the records and /proc, and taking stacks on a signal. Nothing here trusts a worker: a record that
does not parse is ignored with one warning, a dump is read up to a bound.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import mmap
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import node_agent.training.probe as probe
from node_agent.core.stalls import ProcSample
from node_agent.core.steps import ProbeRecord
from node_agent.training import snapshot
from node_agent.workers import owners
from protocol.bounds import MAX_LOCAL_WORLD_SIZE, MAX_NODES

STACKS_SIGNAL = signal.SIGRTMIN + 6     # answered by faulthandler in a worker whose record has the STACKS flag
MAX_DUMP_BYTES = 256 * 1024             # read of one dump (faulthandler stops at 100 frames per thread)
DUMP_WAIT_S = 0.3                       # for a dump to be written (C code, in the signal handler: milliseconds)
_TICKS = os.sysconf("SC_CLK_TCK")


class BadRecord(ValueError):
    """What a worker wrote where its record is read is not a record."""


@dataclass(frozen=True)
class ProbeFiles:
    record: str
    stacks: str

    @classmethod
    def in_dir(cls, root: str, local_rank: int) -> ProbeFiles:
        return cls(os.path.join(root, f"{local_rank}.progress"), os.path.join(root, f"{local_rank}.stacks"))

    def env(self) -> str:
        """NODE_AGENT_PROGRESS for the worker: the probe takes it out of its environment as it starts."""
        return f"{self.record};{self.stacks};{int(STACKS_SIGNAL)}"

    def create(self) -> None:
        """A fresh, empty record (a new round in the same attempt directory starts from nothing)."""
        fd = os.open(self.record, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, probe.SIZE)
            os.pwrite(fd, probe.DIGEST.pack(-1, 0) * probe.DIGESTS, probe.DIGEST_AT)    # no digest yet
            os.pwrite(fd, probe.HELD.pack(-1), probe.HELD_AT)                          # not held
        finally:
            os.close(fd)
        with open(self.stacks, "w"):
            pass


class ProbeRoot:
    """Where this agent's workers' records and stacks live: in /dev/shm when it can (a record is memory the
    worker writes and the agent reads, never a disk write), never in the log directory (its layout stays
    torchrun's); made at the first round, removed when the agent ends."""

    PREFIX = "node-agent-progress."

    def __init__(self) -> None:
        self.root: str | None = None
        self._owner: owners.Ownership | None = None

    def files(self, local_rank: int) -> ProbeFiles:
        """A killed agent's directory is removed by the next agent (its records are of no use to anyone)."""
        if self.root is None:
            shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
            owners.sweep(shm or tempfile.gettempdir(), self.PREFIX)
            self.root = tempfile.mkdtemp(prefix=f"{self.PREFIX}{os.getpid()}.", dir=shm)
            self._owner = owners.claim(self.root)
        return ProbeFiles.in_dir(self.root, local_rank)

    def close(self) -> None:
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None
        if self._owner is not None:
            self._owner.release()
            self._owner = None


class RecordReader:
    """A worker's record, mapped read-only."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), probe.SIZE, prot=mmap.PROT_READ)

    def read(self, pid: int | None, wall_now: float) -> ProbeRecord | None:
        """The record (None: the probe has not started, or is stopped halfway through a step); raises BadRecord
        when it is not one."""
        magic, version = probe.RECORD.unpack_from(self._map, 0)[:2]
        if magic not in (0, probe.MAGIC) or (magic and version != probe.VERSION):
            raise BadRecord(f"magic {magic:#x} version {version}")
        for _ in range(8):      # a step being written: read again (a few microseconds)
            fields = probe.RECORD.unpack_from(self._map, 0)
            pace = probe.PACE.unpack_from(self._map, probe.PACE_AT)
            seq = fields[2]
            if seq & 1 or probe.SEQ.unpack_from(self._map, probe.SEQ_AT)[0] != seq:
                continue
            record = _checked(fields, pid, wall_now)
            if record is not None and _pace_fits(pace):
                record = dataclasses.replace(record, pace=(int(pace[0]), float(pace[1]), float(pace[2])))
            if record is not None:
                record.milestones.update(_milestones(probe.TIMES.unpack_from(self._map, probe.TIMES_AT), wall_now))
                held = probe.HELD.unpack_from(self._map, probe.HELD_AT)[0]
                group = probe.GROUP.unpack_from(self._map, probe.GROUP_AT)[0]
                group = group if 0 <= group <= MAX_NODES * MAX_LOCAL_WORLD_SIZE else 0
                record = dataclasses.replace(record, digests=self._digests(), held_step=max(-1, held),
                                             replica_group=group)
            return record
        return None

    def _digests(self) -> tuple[tuple[int, int], ...]:
        """(step, digest) of the worker's newest snapshots, oldest first (a slot being written is left out)."""
        found = []
        for slot in range(probe.DIGESTS):
            at = probe.DIGEST_AT + slot * probe.DIGEST.size
            step, value = probe.DIGEST.unpack_from(self._map, at)
            if step >= 0 and probe.STEP_OF.unpack_from(self._map, at)[0] == step:
                found.append((step, value))
        return tuple(sorted(found))

    def close(self) -> None:
        self._map.close()


def _checked(fields: tuple[int | float, ...], pid: int | None, wall_now: float) -> ProbeRecord | None:
    magic, _, _, steps, first, last, rec_pid, flags, main_thread, resumed = fields
    if magic == 0:
        return None
    if pid is not None and rec_pid != pid:
        raise BadRecord(f"written by pid {rec_pid}, not the worker's {pid}")
    if not all(math.isfinite(t) for t in (first, last)) or (steps and not 0 < first <= last <= wall_now + 60):
        raise BadRecord(f"step times {first!r}..{last!r}")
    return ProbeRecord(steps=int(steps), first_at=float(first), last_at=float(last), pid=int(rec_pid),
                       flags=int(flags), main_thread=int(main_thread), resumed_step=int(resumed),
                       waits_measured=bool(int(flags) & probe.SYNCED), on_device=bool(int(flags) & probe.ON_DEVICE))


def _pace_fits(pace: tuple[int, float, float]) -> bool:
    """Counted steps, their time and the time waited in them: a wait longer than the time is no pace."""
    steps, took, waited = pace
    return math.isfinite(took) and math.isfinite(waited) and 0 <= waited <= took and (steps > 0 or took == 0)


def read_proc(pid: int) -> ProcSample | None:
    """A look at the worker's main thread in /proc; None once it is gone (or a zombie's parts are)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
        with open(f"/proc/{pid}/task/{pid}/schedstat", "rb") as f:
            ran_ns, waited_ns = (int(x) for x in f.read().split()[:2])
    except (OSError, ValueError):
        return None
    rest = stat[stat.rfind(")") + 2:].split()
    if not rest:
        return None
    io_bytes, process_cpu_s = 0, 0.0
    with contextlib.suppress(OSError, ValueError):
        with open(f"/proc/{pid}/io", "rb") as f:
            counters = dict(line.split(b": ") for line in f.read().splitlines())
        io_bytes = int(counters[b"rchar"]) + int(counters[b"wchar"])
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().decode(errors="replace").rsplit(")", 1)[1].split()
        process_cpu_s = (int(fields[11]) + int(fields[12])) / _TICKS     # utime + stime of every thread
    return ProcSample(state=rest[0], cpu_s=ran_ns / 1e9, run_delay_s=waited_ns / 1e9, io_bytes=io_bytes,
                      process_cpu_s=process_cpu_s)


async def take_stacks(targets: dict[int, tuple[int, str]], clock: Callable[[], float] = time.monotonic
                      ) -> dict[int, str]:
    """Each target's (local rank -> (pid, stacks file)) dump: the file emptied, the signal sent, the dump read once
    it stops growing (up to DUMP_WAIT_S). A rank whose dump did not come has none."""
    sent: dict[int, str] = {}
    for lr, (pid, path) in targets.items():
        try:
            os.truncate(path, 0)
            os.kill(pid, STACKS_SIGNAL)
        except OSError:
            continue
        sent[lr] = path
    sizes: dict[int, int] = {}
    deadline = clock() + DUMP_WAIT_S
    while sent and clock() < deadline:
        await asyncio.sleep(0.02)        # the worker writes in its own time; nothing to wait on but the file
        now = {lr: snapshot.size(path) for lr, path in sent.items()}
        if all(size > 0 and sizes.get(lr) == size for lr, size in now.items()):
            break
        sizes = now
    return {lr: _read_dump(path) for lr, path in sent.items()}


def _read_dump(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(MAX_DUMP_BYTES).decode(errors="replace")
    except OSError:
        return ""


def _milestones(times: tuple[float, ...], wall_now: float) -> dict[str, float]:
    """The milestones the worker noted; a time that is not one is a BadRecord."""
    if not all(math.isfinite(t) and 0 <= t <= wall_now + 60 for t in times):
        raise BadRecord(f"milestone times {times!r}")
    return {name: t for name, t in zip(probe.MILESTONES, times, strict=True) if t}
