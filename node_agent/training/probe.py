"""The progress probe, inside a worker before the user's code runs: standard library only, never torch.

It counts training steps with no change to the script: once `torch.optim.optimizer` is imported (by the
script, or before the fork in a warm interpreter) a global optimizer-step hook counts every step of every
`torch.optim` optimizer; `node_agent.heartbeat.beat()` counts too, for loops stepping none. Each step goes
into a 64-byte record the agent maps as well (no system call per step). On a signal, faulthandler (C code:
it answers while the main thread is blocked in a collective) writes every thread's Python stack to a file.

The agent gives `NODE_AGENT_PROGRESS=RECORD;STACKS;SIGNAL`; `install()` takes it out of the environment, so
the worker's own children (DataLoader workers, subprocesses) never count as the worker.
"""
from __future__ import annotations

import faulthandler
import functools
import importlib.abc
import mmap
import os
import socket
import struct
import sys
import threading
import time
from typing import Any

ENV = "NODE_AGENT_PROGRESS"
RANK_FIELD = "{local_rank}"   # in ENV's paths: the worker's LOCAL_RANK (the torchrun plugin's workers share one ENV)
# The one name it runs under in a worker: its loader registers it so, and beat() looks it up (heartbeat.py).
NAME = "node_agent_probe"
# Its loader: boot/sitecustomize.py, run at the start-up of an interpreter whose PYTHONPATH begins with that folder
# (a cold worker, the warm zygote: workers/environment.booted). It loads this file by path, so a worker imports
# nothing else of ours.
MAGIC, VERSION = 0x4E505247, 3
# magic, version, seq (odd while a step is written), steps, first and last step (unix time), pid, flags, the
# main thread's id (as faulthandler prints it), the step node_agent.snapshot resumed from (-1: none)
RECORD = struct.Struct("<IIQQddIIQq")
# Then when the worker reached each milestone of its start (unix times, 0: not yet, or never): the restart's
# anatomy (node_agent/core/anatomy.py). Each is written once, by the worker's main thread, 8 bytes aligned.
MILESTONES = ("started", "cuda_begun", "cuda_done", "group_begun", "group_done", "restore_begun", "restore_done")
TIMES = struct.Struct(f"<{len(MILESTONES)}d")
TIMES_AT = RECORD.size                # 64
# Then the newest DIGESTS snapshots' digests of the tensors every replica holds alike (DDP's parameters), in
# turn: each slot its step (-1: none, or being written) and the digest; the step is written last, so a reader
# that sees it twice around the digest has a digest of that step (the server compares the replicas:
# rdzv_server/core/divergence.py).
DIGEST = struct.Struct("<qQ")
DIGESTS = 4
DIGEST_AT = TIMES_AT + TIMES.size     # 120
STEP_OF = struct.Struct("<q")
# Then the worker's pace, for who the job waits on (rdzv_server/core/slow.py): the steps counted, their time and
# how long of it the main thread was blocked inside a backward pass or a collective (waiting on the other ranks;
# a rank the others wait on waits least, whether it computes, sleeps or reads more). Written with the step.
PACE = struct.Struct("<Qdd")
PACE_AT = DIGEST_AT + DIGESTS * DIGEST.size      # 184
# Then the step of the snapshot the worker waits after, as its agent asked (-1: none; snapshot.hold_after).
HELD = struct.Struct("<q")
HELD_AT = PACE_AT + PACE.size    # 208
# Then which replicas the digests are compared with: the ranks that tell the same group (0: every rank, as DDP's).
GROUP = struct.Struct("<q")
GROUP_AT = HELD_AT + HELD.size   # 216
SIZE = GROUP_AT + GROUP.size     # 224
SEQ = struct.Struct("<Q")
STEP = struct.Struct("<Qdd")          # steps, first, last: written between two seq updates
FLAG = struct.Struct("<I")
RESUMED = struct.Struct("<q")
SEQ_AT, STEP_AT, FLAGS_AT, RESUMED_AT = 8, 16, 44, 56
# flags: an optimizer hook counts; beat() was called; stacks answer; a wait on the others was measured; the
# collectives run on an accelerator (DEVICE_BACKENDS), where the host does not wait for them (the wait unseen)
HOOKED, BEATEN, STACKS, SYNCED, ON_DEVICE = 1, 2, 4, 8, 16
DEVICE_BACKENDS = ("nccl", "xccl", "hccl")
# A step over OUTLIER x the typical one (an evaluation, a rank's solo work, a pause) is left out of the pace: it
# says nothing of the node's speed. The typical step follows the counted ones (an exponential mean).
OUTLIER = 4.0
TYPICAL_WEIGHT = 0.1
# What a rank waits in for the others: backward (DDP's all-reduce ends there) and the blocking collectives.
SYNC_CALLS = {"torch.autograd": ("backward",),
              "torch.distributed.distributed_c10d": (
                  "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                  "broadcast", "reduce", "barrier", "all_to_all", "all_to_all_single", "gather", "scatter",
                  "all_gather_object", "broadcast_object_list")}
OPTIMIZER_MODULE = "torch.optim.optimizer"
STORE_POLL_S, STORE_WAIT_S, STORE_SAY_S = 0.005, 60.0, 5.0     # _store_listening


class Record:
    """The worker's side of its record: a file the agent made, mapped shared."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size < SIZE:
                os.ftruncate(fd, SIZE)
            self.map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self.seq = 0
        self.steps = 0
        self.first = 0.0
        self.flags = 0
        RECORD.pack_into(self.map, 0, MAGIC, VERSION, 0, 0, 0.0, 0.0, os.getpid(), 0,
                         threading.main_thread().ident or 0, -1)
        TIMES.pack_into(self.map, TIMES_AT, *([0.0] * len(MILESTONES)))
        for slot in range(DIGESTS):
            DIGEST.pack_into(self.map, DIGEST_AT + slot * DIGEST.size, -1, 0)
        self.digests = 0
        self.marked: set[str] = set()
        self.mark("started")
        self.pace = Pace()
        PACE.pack_into(self.map, PACE_AT, 0, 0.0, 0.0)
        HELD.pack_into(self.map, HELD_AT, -1)
        GROUP.pack_into(self.map, GROUP_AT, 0)

    def mark(self, milestone: str) -> None:
        """The worker reached `milestone` now (the first time only)."""
        if milestone not in self.marked:
            self.marked.add(milestone)
            struct.pack_into("<d", self.map, TIMES_AT + 8 * MILESTONES.index(milestone), time.time())

    def step(self) -> None:
        now = time.time()
        if not self.steps:
            self.first = now
        self.steps += 1
        self.pace.stepped(now)
        seq = self.seq
        SEQ.pack_into(self.map, SEQ_AT, seq + 1)
        STEP.pack_into(self.map, STEP_AT, self.steps, self.first, now)
        PACE.pack_into(self.map, PACE_AT, self.pace.steps, self.pace.took_s, self.pace.waited_s)
        SEQ.pack_into(self.map, SEQ_AT, seq + 2)
        self.seq = seq + 2

    def flag(self, bit: int) -> None:
        self.flags |= bit
        FLAG.pack_into(self.map, FLAGS_AT, self.flags)


class Pace:
    """The steps counted for the pace, their time and the time waited in them (OUTLIER: which count)."""

    def __init__(self) -> None:
        self.steps, self.took_s, self.waited_s = 0, 0.0, 0.0
        self.waiting = 0.0          # blocked since the last step
        self.last_at = 0.0
        self.typical = 0.0

    def stepped(self, now: float) -> None:
        waited, self.waiting = self.waiting, 0.0
        if self.last_at:
            took = max(0.0, now - self.last_at)
            self.typical = self.typical or took
            if took <= OUTLIER * self.typical:
                self.steps += 1
                self.took_s += took
                self.waited_s += min(waited, took)
            self.typical += TYPICAL_WEIGHT * (min(took, OUTLIER * self.typical) - self.typical)
        self.last_at = now


class Blocked:
    """The main thread's time blocked in a call: wall time less its CPU time and its wait for a CPU (a busy
    machine's run queue is no wait on the others). Calls from other threads, inside one, or that only start an
    operation (`async_op=True`: its wait comes later, in a backward or a blocking call) are not timed."""

    def __init__(self) -> None:
        self.main = threading.main_thread().ident
        self.depth = 0
        try:
            self.fd = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
        except OSError:
            self.fd = -1

    def run_delay(self) -> float:
        try:
            return int(os.pread(self.fd, 128, 0).split()[1]) / 1e9 if self.fd >= 0 else 0.0
        except (OSError, ValueError, IndexError):
            return 0.0

    def call(self, call: Any, args: Any, kwargs: Any) -> Any:
        if _record is None or self.depth or kwargs.get("async_op") or threading.get_ident() != self.main:
            return call(*args, **kwargs)
        self.depth += 1
        wall, cpu, delay = time.perf_counter(), time.thread_time(), self.run_delay()
        try:
            return call(*args, **kwargs)
        finally:
            self.depth -= 1
            blocked = time.perf_counter() - wall - (time.thread_time() - cpu) - (self.run_delay() - delay)
            _record.pace.waiting += max(0.0, blocked)
            if not _record.flags & SYNCED:
                _record.flag(SYNCED)


_record: Record | None = None
_blocked: Blocked | None = None
_stacks: Any = None        # the open stacks file: faulthandler writes to it from C, so it stays open


def step() -> None:
    """One training step: the optimizer hook's, or beat()'s."""
    if _record is not None:
        _record.step()


def beat() -> None:
    """`node_agent.heartbeat.beat()`: a step, and the job's own progress signal."""
    if _record is not None:
        if not _record.flags & BEATEN:
            _record.flag(BEATEN)
        _record.step()


def resumed(step: int) -> None:
    """The script resumed from its checkpoint of `step` (node_agent.snapshot says so): steps redone are counted."""
    if _record is not None:
        RESUMED.pack_into(_record.map, RESUMED_AT, max(-1, int(step)))


def digest(step: int, value: int, group: int = 0) -> None:
    """The snapshot of `step`: its replicated tensors' digest, compared with the ranks of `group` (writer thread)."""
    if _record is not None:
        GROUP.pack_into(_record.map, GROUP_AT, max(0, int(group)))
        at = DIGEST_AT + (_record.digests % DIGESTS) * DIGEST.size
        _record.digests += 1
        STEP_OF.pack_into(_record.map, at, -1)
        DIGEST.pack_into(_record.map, at, -1, value & (2**63 - 1))
        STEP_OF.pack_into(_record.map, at, max(0, int(step)))


def held(step: int) -> None:
    if _record is not None:
        HELD.pack_into(_record.map, HELD_AT, max(0, int(step)))


def mark(milestone: str) -> None:
    """The worker reached `milestone` (one of MILESTONES) now."""
    if _record is not None:
        _record.mark(milestone)


def _hook(module: Any) -> None:
    register = getattr(module, "register_optimizer_step_post_hook", None)
    if register is not None and _record is not None and not _record.flags & HOOKED:
        register(lambda optimizer, args, kwargs: step())
        _record.flag(HOOKED)


def _timed(module: Any, name: str, phase: str, after: Any = None, before: Any = None) -> None:
    """`module.name` marks `phase`_begun and _done around its first call (the C code looks it up by name), calls
    `before(args, kwargs)` first and `after(module)` once it returned."""
    call = getattr(module, name, None)
    if call is None or getattr(call, "_node_agent_timed", False):
        return

    @functools.wraps(call)
    def timed(*args: Any, **kwargs: Any) -> Any:
        if _record is None:
            return call(*args, **kwargs)
        _record.mark(f"{phase}_begun")
        if before is not None:
            before(args, kwargs)
        out = call(*args, **kwargs)
        _record.mark(f"{phase}_done")
        if after is not None:
            after(module)
        return out
    timed._node_agent_timed = True  # type: ignore[attr-defined]
    setattr(module, name, timed)


def _synced(module: Any) -> None:
    """SYNC_CALLS[module] time the main thread's blocked time in them (and in torch.distributed's copies)."""
    dist = sys.modules.get("torch.distributed") if module.__name__.startswith("torch.distributed.") else None
    for name in SYNC_CALLS[module.__name__]:
        call = getattr(module, name, None)
        if call is None or getattr(call, "_node_agent_synced", False):
            continue

        def synced(*args: Any, _call: Any = call, **kwargs: Any) -> Any:
            return _blocked.call(_call, args, kwargs) if _blocked is not None else _call(*args, **kwargs)
        functools.update_wrapper(synced, call)
        synced._node_agent_synced = True  # type: ignore[attr-defined]
        setattr(module, name, synced)
        if dist is not None and getattr(dist, name, None) is call:
            setattr(dist, name, synced)


def _backend_noted(module: Any) -> None:
    """The default group's collectives run on an accelerator (NCCL, "cuda:nccl,cpu:gloo"): flagged ON_DEVICE."""
    try:
        backend = str(module.get_backend()).lower()
    except Exception:       # noqa: BLE001 - the probe never fails the worker's own call
        return
    if _record is not None and any(name in backend for name in DEVICE_BACKENDS) and not _record.flags & ON_DEVICE:
        _record.flag(ON_DEVICE)


def _store_listening(args: Any, kwargs: Any) -> None:
    """Where the agent hosts the round's c10d store (TORCHELASTIC_USE_AGENT_STORE=True, env://), wait until it
    listens, trying every STORE_POLL_S: the store starts as its node's round does, often just after another
    node's workers, and torch's first connect refused sleeps 250-750 ms (its backoff) before it tries again.
    Bounded by STORE_WAIT_S and the call's own timeout, said past STORE_SAY_S; then torch's connect goes on."""
    try:
        init = kwargs.get("init_method", args[1] if len(args) > 1 else None)
        if (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or init not in (None, "env://")
                or kwargs.get("store", args[5] if len(args) > 5 else None) is not None):
            return
        where = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        timeout = kwargs.get("timeout", args[2] if len(args) > 2 else None)
        limit = min(STORE_WAIT_S, timeout.total_seconds()) if timeout is not None else STORE_WAIT_S
        start, said = time.monotonic(), False
        while True:
            try:
                socket.create_connection(where, timeout=1.0).close()
                return
            except socket.gaierror:
                return          # torch says what is wrong with the name
            except OSError:
                waited = time.monotonic() - start
                if waited + STORE_POLL_S > limit:
                    return
                if not said and (said := waited + STORE_POLL_S >= STORE_SAY_S):   # once (a loaded host: late tries)
                    print(f"[node-agent] the round's c10d store at {where[0]}:{where[1]} is not listening after "
                          f"{STORE_SAY_S:g}s (its node's agent starts it): waiting up to {limit:g}s", file=sys.stderr)
                time.sleep(STORE_POLL_S)
    except Exception:       # noqa: BLE001 - the probe never fails the worker's own call
        return


def _hook_group(module: Any) -> None:
    """init_process_group: in torch.distributed too when it is imported already (a warm worker's fork)."""
    _timed(module, "init_process_group", "group", after=_backend_noted, before=_store_listening)
    _synced(module)
    dist, timed = sys.modules.get("torch.distributed"), getattr(module, "init_process_group", None)
    if dist is not None and timed is not None and getattr(dist, "init_process_group", None) is not timed:
        setattr(dist, "init_process_group", timed)   # noqa: B010  (a module of torch: mypy knows no attribute)


def _hook_cuda(module: Any) -> None:
    """CUDA's lazy initialisation: the context is made there."""
    if not getattr(module, "is_initialized", lambda: True)():
        _timed(module, "_lazy_init", "cuda")


HOOKS = {OPTIMIZER_MODULE: _hook, "torch.distributed.distributed_c10d": _hook_group, "torch.cuda": _hook_cuda,
         "torch.autograd": _synced}


class _HookOnImport(importlib.abc.MetaPathFinder):
    """Hooks torch's modules (HOOKS) as they are imported, without importing torch itself."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in HOOKS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    _hook_after(spec.loader, HOOKS[fullname])
                return spec
        return None


def _hook_after(loader: Any, hook: Any) -> None:
    run = loader.exec_module

    def exec_module(module: Any) -> None:
        run(module)
        hook(module)
    loader.exec_module = exec_module


def install(environ: Any = os.environ) -> bool:
    """Count steps and answer for stacks as `NODE_AGENT_PROGRESS` says (taking it out); False without it, or with
    RANK_FIELD and no LOCAL_RANK. Never raises: a probe that cannot start leaves the worker as it was."""
    global _record, _stacks, _blocked
    spec, rank = environ.pop(ENV, ""), environ.get("LOCAL_RANK", "")
    parts = spec.replace(RANK_FIELD, rank).split(";")
    if len(parts) != 3 or _record is not None or (RANK_FIELD in spec and not rank.isdigit()):
        return False
    try:
        _record = Record(parts[0])
    except (OSError, ValueError):
        return False
    _blocked = Blocked()
    try:
        _stacks = open(parts[1], "a")  # noqa: SIM115 - faulthandler needs it open for the worker's life
        faulthandler.register(int(parts[2]), file=_stacks, all_threads=True, chain=False)
        _record.flag(STACKS)
    except (OSError, ValueError, RuntimeError, AttributeError):
        pass        # no stacks: the agent never sends the signal to a worker without the flag
    for name, hook in HOOKS.items():
        module = sys.modules.get(name)
        if module is not None:      # imported before the fork (a warm worker)
            hook(module)
    if any(name not in sys.modules for name in HOOKS):
        sys.meta_path.insert(0, _HookOnImport())
    return True
