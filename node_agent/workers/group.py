"""One round's local workers (each a `Worker`, process.py) as a group, with the rules that concern them together:
- all start from the warm zygote or all cold; a zygote still importing is waited for up to `warm_wait_s`;
- a `store` launch (the round's c10d store host) starts first, and its end before the workers' fails the round;
- a worker that cannot be spawned gets those already started killed;
- `wait()` returns the moment any worker fails, or once all succeeded;
- `stop()` signals every group (and continues stopped ones), SIGKILL after the stop timeout, then ends what the
  workers left there; the agent's own stop first lets the snapshot writes under way end (writes.py).
"""
from __future__ import annotations

import asyncio
import signal

from node_agent.training import snapshot
from node_agent.workers import leftovers
from node_agent.workers.launch import WorkerLaunch
from node_agent.workers.output import Console
from node_agent.workers.process import Worker, WorkerExit, WorkerSpawnError
from node_agent.workers.warm.client import WarmZygote
from node_agent.workers.writes import Writes

_KILL_WAIT_S = 10.0             # after SIGKILL, how long to wait for a reap before giving up on it
_DRAIN_WAIT_S = 2.0             # after the workers are gone, how long their pipes may stay open


class WorkerGroup:
    """One round's local workers. Not reusable: the next round makes a new group."""

    def __init__(self, launches: list[WorkerLaunch], *, stop_timeout: float,
                 console: Console | None = None,
                 kill_timeout: float = _KILL_WAIT_S, warm: WarmZygote | None = None,
                 warm_wait_s: float = 0.0, store: WorkerLaunch | None = None) -> None:
        self._launches = list(launches)
        self._kill_timeout = kill_timeout
        self.stuck_pids: list[int] = []      # workers still alive kill_timeout after SIGKILL
        self._warm = warm                    # forks the workers it can (warm/), the others start cold
        self._warm_wait_s = warm_wait_s      # how long start() waits for a zygote still importing
        self._stop_asked = asyncio.Event()
        self._store_launch = store
        self._store: Worker | None = None    # the store host, once spawned
        self._store_exit: WorkerExit | None = None
        self._stop_timeout = stop_timeout
        self._console = console or Console()
        self._workers: list[Worker] = []     # those spawned, in local-rank order
        self._exits: list[WorkerExit] = []   # in the order they were reaped
        self._changed = asyncio.Event()      # set (and replaced) at every exit
        self._started = False
        self._stopping: asyncio.Task[None] | None = None
        self._start_done = asyncio.Event()
        self._writes = Writes(launch.env.get(snapshot.DIR_VAR) for launch in self._launches)

    @property
    def launches(self) -> list[WorkerLaunch]:
        return list(self._launches)

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self._workers if w.pid is not None]

    @property
    def warm_pids(self) -> list[int]:
        """The workers forked by the warm zygote."""
        return [w.pid for w in self._workers if w.pid is not None and w.warm]

    @property
    def stopping(self) -> bool:
        return self._stopping is not None

    def exits(self) -> list[WorkerExit]:
        return list(self._exits)

    def pid_of(self, local_rank: int) -> int | None:
        return next((w.pid for w in self._workers if w.launch.local_rank == local_rank), None)

    async def start(self) -> None:
        """Spawn every worker until a stop() comes; one that cannot spawn gets the rest killed: WorkerSpawnError."""
        if self._started:
            raise RuntimeError("a WorkerGroup starts once")
        self._started = True
        failed: tuple[WorkerLaunch, OSError] | None = None
        store = self._store_launch
        try:
            warm = await self._round_zygote()
            for launch in ([] if store is None else [store]) + self._launches:   # the store host first
                if self.stopping:   # a stop() came while the previous one was being spawned
                    break
                worker = Worker(launch, console=self._console, warm=warm,
                                on_exit=self._store_reaped if launch is store else self._reaped)
                try:
                    await worker.start()
                except OSError as e:
                    failed = (launch, e)
                    break
                finally:
                    if worker.pid is not None:   # spawned, even if its output could not be attached
                        if launch is store:
                            self._store = worker
                        else:
                            self._workers.append(worker)
        finally:
            self._start_done.set()   # stop() waits for this, so it sees every worker we spawned
        if failed is not None:
            await self.stop(signal.SIGKILL)
            raise WorkerSpawnError(*failed) from failed[1]

    async def _round_zygote(self) -> WarmZygote | None:
        """The zygote if this round starts warm, decided once for all its workers: a warm worker would be
        seconds ahead of cold peers (and a fast failure could stop them before they ran)."""
        zygote = self._warm
        if zygote is None:
            return None
        if not zygote.ready and zygote.coming and self._warm_wait_s > 0 and not self.stopping:
            waits = [asyncio.ensure_future(zygote.wait_ready(self._warm_wait_s)),
                     asyncio.ensure_future(self._stop_asked.wait())]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiting in waits:
                    waiting.cancel()
        return zygote if zygote.ready else None

    def _reaped(self, exit_: WorkerExit) -> None:
        self._exits.append(exit_)
        self._tell()

    def _store_reaped(self, exit_: WorkerExit) -> None:
        self._store_exit = exit_
        self._tell()

    def _tell(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait(self) -> list[WorkerExit]:
        """Return the failed exits as soon as any worker fails, or every exit once all succeeded."""
        if not self._started:
            raise RuntimeError("wait() before start()")
        await self._start_done.wait()
        while True:
            failed = [e for e in self._exits if e.exitcode != 0]
            if self._store_exit is not None and len(self._exits) < len(self._workers):
                failed.append(self._store_exit)   # even with status 0: the workers have no store now
            if failed:
                return failed
            if len(self._exits) == len(self._workers):
                return list(self._exits)
            await self._changed.wait()

    def send_signal(self, sig: int) -> None:
        """Forward `sig` to the process group of every worker still running."""
        for worker in self._workers:
            worker.send_signal(sig)

    async def stop(self, sig: int = signal.SIGTERM, finish_writes: bool = False) -> None:
        """Stop every worker: `sig` (with `finish_writes`, once their snapshot writes under way ended: writes.py),
        then SIGKILL after stop_timeout; reap all, finish their logs. Later calls wait for the same stop; a later
        SIGKILL cuts the grace period short (a second Ctrl-C)."""
        if self._stopping is None:
            self._stop_asked.set()
            self._stopping = asyncio.create_task(self._stop(sig, finish_writes))
        elif sig == signal.SIGKILL and not self._stopping.done():
            self._signal_groups(signal.SIGKILL)
        await asyncio.shield(self._stopping)

    async def _stop(self, sig: int, finish_writes: bool) -> None:
        if self._started:
            await self._start_done.wait()   # at most the spawn in flight: start() checks for us
        held = leftovers.held_temp_dirs(self._live_groups())   # a killed process removes none (leftovers.py)
        if finish_writes and sig != signal.SIGKILL:
            await self._writes.ended(lambda: [w.launch.env.get(snapshot.DIR_VAR) for w in self._workers
                                              if w.reaper is not None and not w.reaper.done()], self._stop_timeout)
        self._signal_groups(sig)
        self._signal_groups(signal.SIGCONT)   # a stopped worker (SIGSTOP, a debugger) acts on `sig` only once running
        running = [w.reaper for w in self._processes() if w.reaper is not None and not w.reaper.done()]
        if running:
            _, late = await asyncio.wait(running, timeout=self._stop_timeout)
            if late:
                self._signal_groups(signal.SIGKILL)
                _, stuck = await asyncio.wait(late, timeout=self._kill_timeout)
                if stuck:   # uninterruptible sleep (D state): nothing more to do; the agent leaves
                    self.stuck_pids = [w.pid for w in self._processes() if w.reaper in stuck and w.pid is not None]
                    self._console.line("stderr", f"{len(stuck)} worker(s) still alive "
                                                 f"{self._kill_timeout:g}s after SIGKILL")
        # Children of the workers left in their groups die with them: nobody supervises them now.
        self._signal_groups(signal.SIGKILL)
        leftovers.remove(held)
        pending = [f for w in self._processes() for f in w.output_pending()]
        if pending:
            _, open_ = await asyncio.wait(pending, timeout=_DRAIN_WAIT_S)
            if open_:   # a process outside the groups holds a pipe: stop reading, keep what we have
                for worker in self._processes():
                    worker.close_output()
                await asyncio.wait(open_, timeout=_DRAIN_WAIT_S)

    def _live_groups(self) -> set[int]:
        return {w.pid for w in self._processes() if w.pid is not None and w.group_alive}

    def _signal_groups(self, sig: int) -> None:
        for worker in self._processes():
            worker.signal_group(sig)

    def _processes(self) -> list[Worker]:
        """The workers and the store host: what a stop must end."""
        return [*self._workers, *([self._store] if self._store is not None else [])]
