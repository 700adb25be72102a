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
import struct
import sys
import threading
import time
from typing import Any

ENV = "NODE_AGENT_PROGRESS"
# The one name it runs under in a worker: its loader registers it so, and beat() looks it up (heartbeat.py).
NAME = "node_agent_probe"
# Its loader: boot/sitecustomize.py, run at the start-up of an interpreter whose PYTHONPATH begins with BOOT_DIR
# (a cold worker, the warm zygote). It loads this file by path, so a worker imports nothing else of ours.
BOOT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "boot")
MAGIC, VERSION = 0x4E505247, 2
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
SIZE = DIGEST_AT + DIGESTS * DIGEST.size     # 184
SEQ = struct.Struct("<Q")
STEP = struct.Struct("<Qdd")          # steps, first, last: written between two seq updates
FLAG = struct.Struct("<I")
RESUMED = struct.Struct("<q")
SEQ_AT, STEP_AT, FLAGS_AT, RESUMED_AT = 8, 16, 44, 56
HOOKED, BEATEN, STACKS = 1, 2, 4      # flags: an optimizer hook counts; beat() was called; stacks answer
OPTIMIZER_MODULE = "torch.optim.optimizer"


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
        seq = self.seq
        SEQ.pack_into(self.map, SEQ_AT, seq + 1)
        STEP.pack_into(self.map, STEP_AT, self.steps, self.first, now)
        SEQ.pack_into(self.map, SEQ_AT, seq + 2)
        self.seq = seq + 2

    def flag(self, bit: int) -> None:
        self.flags |= bit
        FLAG.pack_into(self.map, FLAGS_AT, self.flags)


_record: Record | None = None
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


def digest(step: int, value: int) -> None:
    """The snapshot of `step`: its replicated tensors' digest (from the snapshot's writer thread)."""
    if _record is not None:
        at = DIGEST_AT + (_record.digests % DIGESTS) * DIGEST.size
        _record.digests += 1
        STEP_OF.pack_into(_record.map, at, -1)
        DIGEST.pack_into(_record.map, at, -1, value & (2**63 - 1))
        STEP_OF.pack_into(_record.map, at, max(0, int(step)))


def restore_began() -> None:
    if _record is not None:
        _record.mark("restore_begun")


def restored() -> None:
    if _record is not None:
        _record.mark("restore_done")


def _after_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    step()


def _hook(module: Any) -> None:
    register = getattr(module, "register_optimizer_step_post_hook", None)
    if register is not None and _record is not None and not _record.flags & HOOKED:
        register(_after_step)
        _record.flag(HOOKED)


def _timed(module: Any, name: str, phase: str) -> None:
    """`module.name` marks `phase`_begun and _done around its first call (the C code looks it up by name)."""
    call = getattr(module, name, None)
    if call is None or getattr(call, "_node_agent_timed", False):
        return

    @functools.wraps(call)
    def timed(*args: Any, **kwargs: Any) -> Any:
        if _record is None:
            return call(*args, **kwargs)
        _record.mark(f"{phase}_begun")
        out = call(*args, **kwargs)
        _record.mark(f"{phase}_done")
        return out
    timed._node_agent_timed = True  # type: ignore[attr-defined]
    setattr(module, name, timed)


def _hook_group(module: Any) -> None:
    """init_process_group: in torch.distributed too when it is imported already (a warm worker's fork)."""
    _timed(module, "init_process_group", "group")
    dist, timed = sys.modules.get("torch.distributed"), getattr(module, "init_process_group", None)
    if dist is not None and timed is not None and getattr(dist, "init_process_group", None) is not timed:
        setattr(dist, "init_process_group", timed)   # noqa: B010  (a module of torch: mypy knows no attribute)


def _hook_cuda(module: Any) -> None:
    """CUDA's lazy initialisation: the context is made there."""
    if not getattr(module, "is_initialized", lambda: True)():
        _timed(module, "_lazy_init", "cuda")


HOOKS = {OPTIMIZER_MODULE: _hook, "torch.distributed.distributed_c10d": _hook_group, "torch.cuda": _hook_cuda}


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


def booted(env: dict[str, str]) -> dict[str, str]:
    """`env` with BOOT_DIR first on PYTHONPATH: the interpreter it starts has the probe before anything runs."""
    path = env.get("PYTHONPATH")
    return {**env, "PYTHONPATH": BOOT_DIR + (os.pathsep + path if path else "")}


def install(environ: Any = os.environ) -> bool:
    """Count steps and answer for stacks as `NODE_AGENT_PROGRESS` says (taking it out); False without it.
    Never raises: a probe that cannot start leaves the worker as it was."""
    global _record, _stacks
    parts = environ.pop(ENV, "").split(";")
    if len(parts) != 3 or _record is not None:
        return False
    record_path, stacks_path, signum = parts
    try:
        _record = Record(record_path)
    except (OSError, ValueError):
        return False
    try:
        _stacks = open(stacks_path, "a")  # noqa: SIM115 - faulthandler needs it open for the worker's life
        faulthandler.register(int(signum), file=_stacks, all_threads=True, chain=False)
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
