"""This node's workers for the round it runs, as a source of facts for the agent's loop (tagged with the round).
A round whose script imports a preloaded package waits (up to WARM_WAIT_S, in the background) for a zygote
still importing, the first round too: its workers would spend that time importing anyway, and a warm worker
ends fast when it fails. `make_group` lets a test put a scripted group in the real one's place.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from node_agent.core.facts import NodeChecked, Put, SpawnFailed, Stage, WorkersExited
from node_agent.core.steps import failed_at_start
from node_agent.settings import DEFAULT_PRELOAD, WorkerSettings
from node_agent.sources import start_source
from node_agent.workers.environment import common_env, worker_argv
from node_agent.workers.failures import early_exits, exit_failure, spawn_failure, store_failure
from node_agent.workers.group import WorkerGroup
from node_agent.workers.launch import STORE_RANK, WorkerLaunch, build_launches, make_run_dir, store_launch
from node_agent.workers.memory import MemoryDirs
from node_agent.workers.probes import ProbeRoot
from node_agent.workers.process import WorkerExit, WorkerSpawnError
from node_agent.workers.step_watch import StepWatch
from node_agent.workers.warm.client import WarmZygote
from node_agent.workers.warm.early_env import SYS_PATH, change, cold_because, preloads_before_a_set
from node_agent.workers.warm.eligible import (
    entry_imports,
    imports_any,
    script_dir,
    script_preloads,
    standard_library_only,
)
from protocol.bounds import MAX_PREPARE_S
from protocol.messages import Assignment, UnhealthyKind
from protocol.notes import ProgressNote

WARM_WAIT_S = MAX_PREPARE_S   # a zygote importing longer (a hung file system?) lets the round start cold


class Group(Protocol):
    """What the agent needs of a round's worker group (`workers.WorkerGroup`, or a test's stand-in)."""

    @property
    def launches(self) -> list[WorkerLaunch]: ...

    @property
    def warm_pids(self) -> list[int]:
        """The workers forked by the warm zygote."""

    @property
    def stuck_pids(self) -> list[int]:
        """Workers still alive after the stop's SIGKILL (uninterruptible sleep)."""

    async def start(self) -> None: ...

    async def wait(self) -> list[WorkerExit]: ...

    def exits(self) -> list[WorkerExit]: ...

    def pid_of(self, local_rank: int) -> int | None: ...

    def send_signal(self, sig: int) -> None: ...

    async def stop(self, sig: int = signal.SIGTERM, finish_writes: bool = False) -> None: ...


class GroupFactory(Protocol):
    def __call__(self, launches: list[WorkerLaunch], *, stop_timeout: float) -> Group: ...


class LocalWorkers:
    def __init__(self, opts: WorkerSettings, put: Put, *, hostname: str, make_group: GroupFactory | None = None,
                 say: Callable[[str], None] = lambda _: None, detect_stalls: bool = True) -> None:
        """`detect_stalls`: examine ranks that stop stepping and report them (the job's hang detection)."""
        self.opts = opts
        self._detect_stalls = detect_stalls
        self._put = put
        self._hostname = hostname
        self._say = say
        self.warm: WarmZygote | None = None   # only real processes start warm: a test's stand-in group gets no zygote
        path0 = os.getcwd() if opts.module else script_dir(opts.script)
        # torch's modules, unless the script and its own modules import only the standard library (read only where
        # a zygote may start: not for --no-python's program)
        torch_free = opts.warm and opts.warm_preload is None and \
            standard_library_only(opts.script, module=opts.module, cwd=os.getcwd(), path0=path0)
        base = opts.warm_preload if opts.warm_preload is not None else () if torch_free else DEFAULT_PRELOAD
        preload = base if opts.warm_preload is not None else \
            (*base, *script_preloads(opts.script, module=opts.module, cwd=os.getcwd(), path0=path0))
        early: tuple[str, str] | None = None
        if opts.warm and make_group is None:
            preload, left_out, early = preloads_before_a_set(opts.script, preload, base, module=opts.module,
                                                             cwd=os.getcwd())
            if left_out is not None and early is None:
                why = "it may be found elsewhere then" if left_out[0] == SYS_PATH else \
                    "what it reads as it loads would not reach it"
                say(f"warm workers: not preloading {left_out[1]}: the script {change(left_out[0])} before it imports "
                    f"it ({why}); the workers import it themselves")
        if early is not None:
            say(cold_because(*early))
        if opts.warm and make_group is None and early is None:
            python = worker_argv(opts)[0]   # the cold path's interpreter: PYTHON_EXEC or ours
            self.warm = WarmZygote(python, preload, path0, common_env(os.environ, opts.nproc), say,
                                   fallback=base if opts.warm_preload is None else None)
        self._make_group: GroupFactory = make_group or self._process_group
        imported = None if opts.no_python else entry_imports(opts.script, module=opts.module, cwd=os.getcwd())
        # a zygote still importing is worth waiting for only when the script imports what it preloads
        self._warm_wait_s = WARM_WAIT_S if self.warm is not None and imports_any(imported, preload) else 0.0
        self._starting: asyncio.Task[None] | None = None   # a start waiting for the zygote
        self._gave_up = False       # the zygote took longer than WARM_WAIT_S to import: ready, to start cold
        # The agent hosts the c10d store for an entry point importing torch: a rule all nodes (one command) agree on.
        self.agent_store = make_group is None and not opts.no_python and imports_any(imported, ("torch",))
        self._round_store: WorkerLaunch | None = None
        self.group: Group | None = None
        self._stopping: Group | None = None     # the group a stop ends
        self.cpu_affinity: Mapping[int, frozenset[int]] = {}   # --numa-binding: local rank -> its CPUs
        self.gpu_busy: Callable[[int], int | None] = lambda _: None   # local rank -> its GPU's utilization, %
        self.stuck_pids: list[int] = []      # workers that outlived SIGKILL (the node is unhealthy)
        self._round = -1
        self._watchers: list[asyncio.Task[None]] = []
        self.steps: StepWatch | None = None       # the round's (kept after its workers end: its last note)
        self._last_step_at = 0.0     # this node's last step of a round before (unix time; 0: none yet)
        self._stopped_at = 0.0       # when a round's workers were last all gone (unix time)
        if opts.no_python:
            say("--no-python: the program gets no progress probe, so no steps, no hang detection, no goodput")
        self._tmp_root: str | None = None   # logs' home when the CLI made no run directory (tests)
        self.memory = MemoryDirs(opts.job_id, opts.nproc, opts.memory_dir_limit, say=say, node_id=opts.node_id)
        self.probes = ProbeRoot()

    def _process_group(self, launches: list[WorkerLaunch], *, stop_timeout: float) -> Group:
        return WorkerGroup(launches, stop_timeout=stop_timeout, kill_timeout=self.opts.kill_timeout,
                           warm=self.warm, warm_wait_s=self._zygote_wait_s, store=self._round_store)

    @property
    def _zygote_wait_s(self) -> float:
        """How long a round waits for a zygote still importing: not again once it took past WARM_WAIT_S (the node
        said ready then, and its round starts cold at once, as the other nodes' workers run already)."""
        return 0.0 if self._gave_up else self._warm_wait_s

    @property
    def ready(self) -> bool:
        """Whether workers can start at once: no warm interpreter the script needs is still on its way (one that
        imports past WARM_WAIT_S is given up on: a cold start then)."""
        return not (self.warm is not None and self._warm_wait_s > 0 and self.warm.coming and not self._gave_up)

    async def until_ready(self) -> None:
        """Return once `ready` (at most WARM_WAIT_S)."""
        if self.warm is not None and not self.ready:
            await self.warm.wait_ready(self._warm_wait_s)
            self._gave_up = self.warm.coming

    def warm_up(self) -> None:
        """Start the warm zygote before the first round, once the agent's environment is final (a zygote
        started before a change would not match it)."""
        if self.warm is not None:
            self.warm.start()

    async def spawn(self, a: Assignment) -> None:
        """Start the round's workers; their news (or the spawn's failure) comes back as facts."""
        if self.group is not None:   # a group whose workers all succeeded: sweep up after it first
            await self.stop()
        opts = self.opts
        try:
            if opts.run_dir is None and self._tmp_root is None:
                self._tmp_root = make_run_dir(opts.log_dir or tempfile.mkdtemp(prefix="node-agent_"), opts.job_id)
            run_dir = opts.run_dir or self._tmp_root or "."
            launches = build_launches(a, opts, run_dir=run_dir, hostname=self._hostname, stdin_tty=os.isatty(0),
                                      memory_dirs=self.memory.dirs(a.local_world_size),
                                      memory_limit=self.memory.rank_limit, cpu_affinity=self.cpu_affinity,
                                      agent_store=self.agent_store, probes=self.probes)
            self._round_store = (store_launch(a, worker_argv(opts)[0], run_dir=run_dir)
                                 if self.agent_store and a.group_rank == 0 else None)
        except OSError as exc:   # no room for the workers' directories: they cannot start
            self._spawn_failed(a.round_id, exc, a.rank_offset, 0, opts.script)
            return
        group = self._make_group(launches, stop_timeout=opts.stop_timeout)
        self.group, self._round = group, a.round_id
        self.steps = self._step_watch(group, a.round_id)
        if self.warm is not None and self._zygote_wait_s > 0 and self.warm.coming:
            # Not awaited: a signal, a new round or the lease must not wait on the zygote's imports.
            self._starting = start_source(self._start(group, a.round_id), self._put)
        else:
            await self._start(group, a.round_id)

    async def _start(self, group: Group, round_id: int) -> None:
        launches = group.launches
        if self.steps is not None and self.steps.round.round_id == round_id:
            self.steps.round.spawned_at = time.time()
            self.steps.round.global_ranks = {launch.local_rank: launch.rank for launch in launches}
        try:
            await group.start()
        except OSError as exc:   # the group killed those already started
            if self.group is group:
                self.group = None
            failed = exc.launch if isinstance(exc, WorkerSpawnError) else launches[0]
            if failed.local_rank == STORE_RANK:   # the store host: said as the node's first worker's
                failed = launches[0]
            self._spawn_failed(round_id, exc, failed.rank, failed.local_rank, failed.argv[0])
            return
        if self.group is not group:   # stopped while it waited for the zygote: nothing was started
            return
        if group.warm_pids:
            self._say(f"{len(group.warm_pids)} of {len(launches)} workers started warm")
        self._watchers.append(start_source(self._watch_exits(group, round_id), self._put))
        if self.steps is not None and self.steps.round.round_id == round_id:
            self._watchers.append(start_source(self.steps.run(self._put), self._put))

    async def stop(self, signum: int = signal.SIGTERM, finish_writes: bool = False) -> None:
        """Stop the running group, if any (up to --stop-timeout, then SIGKILL; `finish_writes`: WorkerGroup.stop)."""
        self._stop_watching()
        group, self.group = self.group, None
        starting, self._starting = self._starting, None
        if group is not None:
            self._stopping = group       # kill() reaches it meanwhile (a second Ctrl-C while it waits for writes)
            try:
                await group.stop(signum, finish_writes)   # also ends a start still waiting for the zygote
            finally:
                self._stopping = None
            self._workers_gone()
            if starting is not None:   # its failure, if any, reached the loop already (start_source)
                await asyncio.wait([starting])
            stuck = list(group.stuck_pids)
            if stuck:      # they would hold the GPU (and this node's workers) forever: the node leaves
                self.stuck_pids = stuck
                self._put(NodeChecked(Stage.STOP, self._round, f"worker process{'es' if len(stuck) > 1 else ''} "
                                      f"{', '.join(map(str, stuck))} still alive {self.opts.kill_timeout:g}s after "
                                      f"SIGKILL (uninterruptible sleep: a GPU or driver fault?)",
                                      UnhealthyKind.STUCK_WORKER))

    def kill(self) -> None:
        """SIGKILL every worker now, without waiting (the agent is about to exit)."""
        for group in (self.group, self._stopping):
            if group is not None:
                group.send_signal(signal.SIGKILL)

    async def close(self, keep_memory: str = "") -> None:
        """`keep_memory`: why this node's snapshots stay for its next agent (MemoryDirs.close)."""
        await self.stop()
        if self.warm is not None:
            await self.warm.close()
        self.memory.close(keep_memory)   # the job ended or the node leaves: its snapshots go, unless kept
        if self.steps is not None:
            self.steps.close()
        self.probes.close()
        if self._tmp_root is not None and self.opts.log_dir is None:
            shutil.rmtree(os.path.dirname(self._tmp_root), ignore_errors=True)

    def _stop_watching(self) -> None:
        for task in self._watchers:
            task.cancel()
        self._watchers.clear()

    def _spawn_failed(self, round_id: int, exc: OSError, rank: int, local_rank: int, program: str) -> None:
        self._put(SpawnFailed(round_id, spawn_failure(exc, local_rank=local_rank, rank=rank, program=program,
                                                      host=self._hostname, node_id=self.opts.node_id)))

    async def _watch_exits(self, group: Group, round_id: int) -> None:
        exits = await group.wait()
        self._workers_gone()
        first = group.launches[0].rank if group.launches else 0
        host, node = self._hostname, self.opts.node_id
        failures = tuple(store_failure(e, rank=first, host=host, node_id=node) if e.local_rank == STORE_RANK
                         else exit_failure(e, host=host, node_id=node,
                                           before_group=self._before_group(round_id, e.local_rank))
                         for e in exits if e.exitcode != 0 or e.local_rank == STORE_RANK)
        if failures:
            earliest = min(failures, key=lambda f: f.timestamp)
            failures = (*early_exits(group.exits(), earliest, host=host, node_id=node),
                        *failures)
        if not failures:   # all done: nothing is left to hang
            for task in self._watchers:
                if task is not asyncio.current_task():
                    task.cancel()
        self._put(WorkersExited(round_id, failures))

    def _before_group(self, round_id: int, local_rank: int) -> bool:
        """Its probe says it failed at start (steps.failed_at_start; read by _workers_gone). It ended by itself:
        the agent's stop ends the watch first (stop), so a worker it stops is no fact at all."""
        steps = self.steps.round if self.steps is not None else None
        seen = steps.ranks.get(local_rank) if steps is not None and steps.round_id == round_id else None
        return failed_at_start(seen.record if seen is not None else None)

    def _workers_gone(self) -> None:
        """The round's workers are all gone: when (the next restart's anatomy), and their records' last word
        read before the next round's files replace them (its last step: where that restart begins)."""
        self._stopped_at = time.time()
        if self.steps is not None:
            self.steps.look()

    def _step_watch(self, group: Group, round_id: int) -> StepWatch | None:
        """The round's step watch, over the workers that have a probe (none: --no-python)."""
        if self.steps is not None:
            self.steps.close()
            self._last_step_at = self.steps.round.last_step_at() or self._last_step_at
        ranks = {launch.local_rank: (launch.rank, launch.probe) for launch in group.launches
                 if launch.probe is not None}
        if not ranks:
            return None

        def exit_of(local_rank: int) -> int | None:
            return next((e.exitcode for e in group.exits() if e.local_rank == local_rank), None)
        watch = StepWatch(round_id, ranks, detect=self._detect_stalls, pid_of=group.pid_of, exit_of=exit_of,
                          warn=self._say, gpu_busy=self.gpu_busy)
        if self._last_step_at and self._stopped_at >= self._last_step_at:
            watch.round.before = (self._last_step_at, self._stopped_at)
        return watch

    def all_stepping(self, round_id: int, count: int) -> bool:
        """Whether `count` local ranks of round `round_id` have each done a step, as the step watch last looked
        (no probe: False)."""
        watch = self.steps
        return watch is not None and watch.round.round_id == round_id and watch.round.all_stepped(count)

    def progress_note(self, round_id: int) -> ProgressNote | None:
        """The round's progress so far, for the next request to the server (None: not this round's, no probe)."""
        watch = self.steps
        if watch is None or watch.round.round_id != round_id:
            return None
        watch.look()
        return watch.note()
