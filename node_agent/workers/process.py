"""One worker process: start it, signal it, reap it, pump its output. Rules:
- Each worker leads its own session, as under torchrun: a stop reaches its children too, a terminal's Ctrl-C
  only the agent, and a worker given the terminal as stdin reads it without job control stopping it.
- Each worker dies with the agent (deathsig.py): else a SIGKILLed agent leaves workers training unsupervised.
- An exit is seen the moment it happens: output goes through pipes of our own, as asyncio (3.11) completes
  `Process.wait()` only once every pipe is closed, which a worker's surviving child may never do.
- A process group is signalled only while it may have members: once seen empty its id may be reused.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from node_agent.workers.deathsig import prctl, preexec
from node_agent.workers.environment import cold_env
from node_agent.workers.launch import WorkerLaunch
from node_agent.workers.output import STREAMS, Console, LinePump, Sink, open_sink, pump
from node_agent.workers.warm.client import WarmProcess, WarmZygote
from node_agent.workers.warm.eligible import warm_launch

# A started worker: a child of the agent or of the warm zygote.
ChildProcess = asyncio.subprocess.Process | WarmProcess


@dataclass(frozen=True)
class WorkerExit:
    local_rank: int
    rank: int
    pid: int
    exitcode: int                # negative: killed by signal -exitcode
    signal_name: str             # "" when it exited by itself
    error_file: str | None       # the worker's TORCHELASTIC_ERROR_FILE, when it wrote one
    seen_at: float = 0.0         # unix time the exit was reaped


class WorkerSpawnError(OSError):
    """A worker could not be started (missing program, not executable, ...); the workers already
    started were killed. errno/strerror are the cause's, so `except OSError` callers keep working."""

    def __init__(self, launch: WorkerLaunch, cause: OSError) -> None:
        super().__init__(cause.errno, cause.strerror or str(cause))
        self.launch = launch

    def __str__(self) -> str:
        return f"cannot start local rank {self.launch.local_rank} ({self.launch.argv[0]!r}): {self.strerror}"


def signal_name(exitcode: int) -> str:
    if exitcode >= 0:
        return ""
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"SIG{-exitcode}"


class Worker:
    """One child process, from its start to its reaping. Not reusable."""

    def __init__(self, launch: WorkerLaunch, *, console: Console,
                 on_exit: Callable[[WorkerExit], None] | None = None, warm: WarmZygote | None = None) -> None:
        self.launch = launch
        self._warm = warm                # start from this zygote when it can (else cold)
        self.warm = False                # this worker was forked by the zygote
        self._console = console
        self._on_exit = on_exit          # called once, when the process has been reaped
        self._proc: ChildProcess | None = None
        self.group_alive = False         # its process group may still have members (the worker's children)
        self._pumps: list[LinePump] = []
        self._transports: list[asyncio.BaseTransport] = []
        self.reaper: asyncio.Task[WorkerExit] | None = None
        self.exit: WorkerExit | None = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def start(self) -> None:
        """Spawn the process and start pumping its output. Raises OSError when it cannot be spawned."""
        launch = self.launch
        if launch.error_file:   # a stale file from an earlier run would be taken for this run's error
            with contextlib.suppress(FileNotFoundError):
                os.unlink(launch.error_file)
        sinks: list[Sink] = []
        fds: list[int] = []
        ends: list[tuple[int, int]] = []   # per stream: (our end to read, or -1; the worker's end)
        try:
            for stream, std in STREAMS:
                sink = open_sink(launch, stream, std, self._console)
                sinks.append(sink)
                if sink.direct is not None:
                    ends.append((-1, sink.direct))
                else:
                    r, w = os.pipe()
                    fds += (r, w)
                    ends.append((r, w))
            self._proc = await self._start_warm(ends[0][1], ends[1][1])
            self.warm = self._proc is not None
            if self._proc is None:
                self._proc = await asyncio.create_subprocess_exec(
                    *launch.argv, env=cold_env(launch.env), stdin=None if launch.stdin_tty else subprocess.DEVNULL,
                    stdout=ends[0][1], stderr=ends[1][1], start_new_session=True,
                    preexec_fn=preexec(os.getpid(), prctl(), launch.cpu_affinity))
        except BaseException:
            for fd in fds:
                os.close(fd)
            for sink in sinks:
                sink.close()
            raise
        self.group_alive = True
        for r, w in ends:
            if r >= 0:
                os.close(w)   # the child has its copy; ours would keep the pipe from ever ending
        self.reaper = asyncio.create_task(self._reap(self._proc))
        for (r, _), sink in zip(ends, sinks, strict=True):
            if r >= 0:
                transport, line_pump = await pump(r, sink)
                self._transports.append(transport)
                self._pumps.append(line_pump)

    async def _start_warm(self, stdout: int, stderr: int) -> ChildProcess | None:
        """Fork the worker from the warm zygote; None when it must start cold (see warm/client.py)."""
        if self._warm is None or not self._warm.ready:
            return None
        plan = warm_launch(self.launch, self._warm.python)
        if plan is None:
            return None
        stdin = 0 if self.launch.stdin_tty else os.open(os.devnull, os.O_RDONLY)
        try:
            return await self._warm.spawn(plan, [stdin, stdout, stderr])
        finally:
            if stdin != 0:
                os.close(stdin)

    async def _reap(self, proc: ChildProcess) -> WorkerExit:
        code = await proc.wait()
        try:
            os.killpg(proc.pid, 0)          # anything left in its group (the worker's children)?
        except OSError:
            self.group_alive = False        # empty: never signal this id again (pid reuse)
        error_file = self.launch.error_file
        if error_file and not os.path.exists(error_file):   # noqa: ASYNC240 - one local stat
            error_file = None
        self.exit = WorkerExit(local_rank=self.launch.local_rank, rank=self.launch.rank, pid=proc.pid,
                               exitcode=code, signal_name=signal_name(code), error_file=error_file,
                               seen_at=time.time())
        if self._on_exit is not None:
            self._on_exit(self.exit)
        return self.exit

    def send_signal(self, sig: int) -> None:
        """Forward `sig` to the worker's process group, if the worker still runs."""
        if self.running:
            self.signal_group(sig)

    def signal_group(self, sig: int) -> None:
        """Send `sig` to the worker's process group (its children included) while it may have members."""
        if not self.group_alive or self._proc is None:
            return
        try:
            os.killpg(self._proc.pid, sig)
        except ProcessLookupError:
            # No such group: gone, or a warm worker just forked that has no session yet; then the process
            # itself (not reaped, so still ours) gets the signal, or the worker would run on.
            if not self.running:
                self.group_alive = False
                return
            try:
                os.kill(self._proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                self.group_alive = False
        except PermissionError:                         # a member changed user: out of reach
            self.group_alive = False

    def output_pending(self) -> list[asyncio.Future[None]]:
        """The worker's streams still open (a surviving child may hold them)."""
        return [p.done for p in self._pumps if not p.done.done()]

    def close_output(self) -> None:
        """Stop reading the worker's streams, keeping what was read."""
        for transport in self._transports:
            transport.close()
