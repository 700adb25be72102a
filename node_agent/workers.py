"""The process layer: spawn one node's workers, pump their output, reap them, stop them.

Rules this module keeps:
- Each worker leads its own process group, so a stop reaches the worker's own children too, and a
  terminal's Ctrl-C reaches only the agent, which decides what the workers get.
- Each worker dies with the agent: PR_SET_PDEATHSIG(SIGKILL) is set in the child before exec, and a
  child whose parent is already gone by then exits at once. Without this, a SIGKILLed agent leaves
  workers training unsupervised (torchrun's orphans).
- An exit is seen the moment it happens. Output goes through pipes we create ourselves rather than
  asyncio's PIPE: asyncio (3.11) only completes `Process.wait()` once every pipe is closed, and a
  worker's surviving child holding stdout open would delay the failure report indefinitely.
- Output is decoded as UTF-8 with replacement, split into lines (a very long line goes on in pieces)
  and written whole: one write per console line, so ranks never interleave inside a line.
"""
from __future__ import annotations

import asyncio
import codecs
import ctypes
import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from node_agent.heartbeat import ENV_FD as HEARTBEAT_ENV
from node_agent.options import Std

_PR_SET_PDEATHSIG = 1
_MAX_PIECE = 64 * 1024          # a line longer than this without a newline is passed on in pieces
_KILL_WAIT_S = 10.0             # after SIGKILL, how long to wait for a reap before giving up on it
_DRAIN_WAIT_S = 2.0             # after the workers are gone, how long their pipes may stay open


@dataclass(frozen=True)
class WorkerLaunch:
    local_rank: int
    rank: int
    argv: list[str]
    env: dict[str, str]
    log_dir: str | None          # this rank's directory for stdout.log / stderr.log
    redirect: Std = Std.NONE     # streams that go to the log file only
    tee: Std = Std.NONE          # streams that go to the log file and the console
    echo: bool = True            # False: kept off the console (--local-ranks-filter)
    prefix: str = ""             # e.g. "[host:rank 3]"
    heartbeat: bool = False      # give the worker a heartbeat pipe (NODE_AGENT_HEARTBEAT_FD)


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
        self.cause = cause

    def __str__(self) -> str:
        return f"cannot start local rank {self.launch.local_rank} ({self.launch.argv[0]!r}): {self.strerror}"


class Console:
    """Where echoed worker lines go: the agent's stdout and stderr unless given other streams."""

    def __init__(self, out: TextIO | None = None, err: TextIO | None = None) -> None:
        self._out = out
        self._err = err
        self._broken: set[str] = set()

    def line(self, stream: str, text: str) -> None:
        """Write one full line (no newline in `text`) to "stdout" or "stderr"."""
        if stream in self._broken:
            return
        target = (self._out or sys.stdout) if stream == "stdout" else (self._err or sys.stderr)
        try:
            target.write(text + "\n")   # one write: a line stays whole even with other writers
            target.flush()
        except (OSError, ValueError):   # closed or broken console: keep logging to files, drop echo
            self._broken.add(stream)


class _LinePump(asyncio.Protocol):
    """Reads one worker stream; sends each line to a log file and/or the console."""

    def __init__(self, file: TextIO | None, echo: Callable[[str], None] | None) -> None:
        self._file = file
        self._echo = echo
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self._feed(self._decoder.decode(data))

    def eof_received(self) -> bool:
        return False   # close the transport: connection_lost then flushes

    def connection_lost(self, exc: Exception | None) -> None:
        self._feed(self._decoder.decode(b"", final=True), final=True)
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
        if not self.done.done():
            self.done.set_result(None)

    def _feed(self, text: str, final: bool = False) -> None:
        *lines, self._pending = (self._pending + text).split("\n")
        for line in lines:
            self._emit(line, newline=True)
        if self._pending and (final or len(self._pending) >= _MAX_PIECE):
            self._emit(self._pending, newline=False)
            self._pending = ""

    def _emit(self, line: str, *, newline: bool) -> None:
        if self._file is not None:
            try:   # the file gets the bytes as written: a piece of a long line gets no newline
                self._file.write(line + "\n" if newline else line)
            except OSError as e:   # disk full and the like: the worker must not block on its pipe
                file, self._file = self._file, None
                if self._echo is not None:
                    self._echo(f"(log file {getattr(file, 'name', '?')} failed: {e}; not writing it)")
        if self._echo is not None:
            self._echo(line)


@functools.cache
def _prctl() -> Any:
    """libc's prctl, loaded in the parent so the child does no library loading after fork."""
    if not sys.platform.startswith("linux"):
        return None
    fn = ctypes.CDLL(None, use_errno=True).prctl
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_int
    return fn


def _child_setup(parent_pid: int, prctl: Any) -> Callable[[], None]:
    def setup() -> None:   # runs in the child between fork and exec
        if sys.version_info < (3, 11):
            os.setpgid(0, 0)   # 3.11+ does this through Popen(process_group=0)
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        # The agent may have died between fork and prctl: then no signal will ever come.
        if os.getppid() != parent_pid:
            os._exit(1)
    return setup


def signal_name(exitcode: int) -> str:
    if exitcode >= 0:
        return ""
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"SIG{-exitcode}"


class WorkerGroup:
    """One round's local workers. Not reusable: the next round makes a new group."""

    def __init__(self, launches: list[WorkerLaunch], *, stop_timeout: float,
                 console: Console | None = None, on_beat: Callable[[int], None] | None = None) -> None:
        self._launches = list(launches)
        self._on_beat = on_beat              # called with the local rank on each heartbeat byte
        self._heartbeat_fds: list[int] = []
        self._stop_timeout = stop_timeout
        self._console = console or Console()
        self._procs: list[asyncio.subprocess.Process] = []
        self._reapers: list[asyncio.Task[None]] = []
        self._pumps: list[_LinePump] = []
        self._transports: list[asyncio.BaseTransport] = []
        self._groups: set[int] = set()     # process groups that may still have members
        self._exits: list[WorkerExit] = []
        self._changed = asyncio.Condition()
        self._started = False
        self._stopping: asyncio.Task[None] | None = None
        self._start_done = asyncio.Event()

    @property
    def launches(self) -> list[WorkerLaunch]:
        return list(self._launches)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def exits(self) -> list[WorkerExit]:
        return list(self._exits)

    async def start(self) -> None:
        """Spawn every worker. A stop() arriving meanwhile ends the spawning; a worker that cannot be
        spawned makes the others be killed and raises WorkerSpawnError."""
        if self._started or self._stopping is not None:
            raise RuntimeError("a WorkerGroup starts once, and not after stop()")
        self._started = True
        prctl = _prctl()
        failed: tuple[WorkerLaunch, OSError] | None = None
        try:
            for launch in self._launches:
                if self._stopping is not None:
                    break
                try:
                    await self._spawn(launch, prctl)
                except OSError as e:
                    failed = (launch, e)
                    break
        finally:
            self._start_done.set()   # stop() waits for this, so it sees every worker we spawned
        if failed is not None:
            await self.stop(signal.SIGKILL)
            raise WorkerSpawnError(*failed) from failed[1]

    async def _spawn(self, launch: WorkerLaunch, prctl: Any) -> None:
        error_file = launch.env.get("TORCHELASTIC_ERROR_FILE")
        if error_file:   # a stale file from an earlier run would be taken for this run's error
            try:
                os.unlink(error_file)
            except FileNotFoundError:
                pass
        sinks: list[tuple[TextIO | None, Callable[[str], None] | None]] = []
        fds: list[int] = []
        extra: dict[str, Any] = {"process_group": 0} if sys.version_info >= (3, 11) else {}
        env = launch.env
        hb_w = -1
        try:
            for stream, std in (("stdout", Std.OUT), ("stderr", Std.ERR)):
                sinks.append(self._sink(launch, stream, std))
            out_r, out_w = os.pipe()
            fds += (out_r, out_w)
            err_r, err_w = os.pipe()
            fds += (err_r, err_w)
            if launch.heartbeat and self._on_beat is not None:
                hb_r, hb_w = os.pipe()
                fds += (hb_r, hb_w)
                os.set_blocking(hb_w, False)   # a worker must never block on its heartbeat
                env = {**env, HEARTBEAT_ENV: str(hb_w)}
                extra["pass_fds"] = (hb_w,)
            proc = await asyncio.create_subprocess_exec(
                *launch.argv, env=env, stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w,
                preexec_fn=_child_setup(os.getpid(), prctl), **extra)
        except BaseException:
            for fd in fds:
                os.close(fd)
            for file, _ in sinks:
                if file is not None:
                    file.close()
            raise
        os.close(out_w)   # the child has its copies; ours would keep the pipes from ever ending
        os.close(err_w)
        if hb_w >= 0:
            os.close(hb_w)
            self._watch_heartbeat(hb_r, launch.local_rank)
        self._procs.append(proc)
        self._groups.add(proc.pid)
        self._reapers.append(asyncio.create_task(self._reap(launch, proc)))
        await self._pump(out_r, sinks[0])
        await self._pump(err_r, sinks[1])

    def _sink(self, launch: WorkerLaunch, stream: str, std: Std
              ) -> tuple[TextIO | None, Callable[[str], None] | None]:
        file: TextIO | None = None
        if launch.log_dir is not None and (launch.redirect | launch.tee) & std:
            os.makedirs(launch.log_dir, exist_ok=True)
            # Append: a directory reused by a later round keeps the earlier output.
            file = open(os.path.join(launch.log_dir, f"{stream}.log"), "a", encoding="utf-8",
                        newline="", buffering=1)
        redirected_only = file is not None and launch.redirect & std and not launch.tee & std
        echo: Callable[[str], None] | None = None
        if launch.echo and not redirected_only:
            head = f"{launch.prefix} " if launch.prefix else ""
            echo = lambda text: self._console.line(stream, head + text)   # noqa: E731
        return file, echo

    async def _pump(self, fd: int, sink: tuple[TextIO | None, Callable[[str], None] | None]) -> None:
        pipe = os.fdopen(fd, "rb", buffering=0)
        try:
            transport, pump = await asyncio.get_running_loop().connect_read_pipe(
                lambda: _LinePump(*sink), pipe)
        except BaseException:
            pipe.close()
            if sink[0] is not None:
                sink[0].close()
            raise
        self._pumps.append(pump)
        self._transports.append(transport)

    async def _reap(self, launch: WorkerLaunch, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        try:
            os.killpg(proc.pid, 0)          # anything left in its group (the worker's children)?
        except OSError:
            self._groups.discard(proc.pid)  # empty: never signal this id again (pid reuse)
        error_file = launch.env.get("TORCHELASTIC_ERROR_FILE")
        if error_file and not os.path.exists(error_file):   # noqa: ASYNC240 - one local stat
            error_file = None
        async with self._changed:
            self._exits.append(WorkerExit(
                local_rank=launch.local_rank, rank=launch.rank, pid=proc.pid, exitcode=code,
                signal_name=signal_name(code), error_file=error_file, seen_at=time.time()))
            self._changed.notify_all()

    async def wait(self) -> list[WorkerExit]:
        """Return the failed exits as soon as any worker fails, or every exit once all succeeded."""
        if not self._started:
            raise RuntimeError("wait() before start()")
        async with self._changed:
            await self._changed.wait_for(
                lambda: any(e.exitcode != 0 for e in self._exits)
                or len(self._exits) == len(self._procs))
            return [e for e in self._exits if e.exitcode != 0] or list(self._exits)

    def send_signal(self, sig: int) -> None:
        """Forward `sig` to the process group of every worker still running."""
        for proc in self._procs:
            if proc.returncode is None:
                self._killpg(proc.pid, sig)

    async def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop every worker: `sig`, then SIGKILL after stop_timeout; reap all, finish their logs.

        Safe to call again or concurrently: later calls wait for the same stop, and a later SIGKILL
        cuts the grace period short (a second Ctrl-C).
        """
        if self._stopping is None:
            self._stopping = asyncio.create_task(self._stop(sig))
        elif sig == signal.SIGKILL and not self._stopping.done():
            self._signal_groups(signal.SIGKILL)
        await asyncio.shield(self._stopping)

    async def _stop(self, sig: int) -> None:
        if self._started:
            await self._start_done.wait()   # at most the spawn in flight: start() checks for us
        self._signal_groups(sig)
        running = [t for t in self._reapers if not t.done()]
        if running:
            _, late = await asyncio.wait(running, timeout=self._stop_timeout)
            if late:
                self._signal_groups(signal.SIGKILL)
                _, stuck = await asyncio.wait(late, timeout=_KILL_WAIT_S)
                if stuck:   # uninterruptible sleep (D state): nothing more we can do
                    self._console.line("stderr", f"{len(stuck)} worker(s) still alive "
                                                 f"{_KILL_WAIT_S:g}s after SIGKILL")
        # Children of the workers left in their groups die with them: nobody supervises them now.
        self._signal_groups(signal.SIGKILL)
        self._close_heartbeats()
        pending = [p.done for p in self._pumps if not p.done.done()]
        if pending:
            _, open_ = await asyncio.wait(pending, timeout=_DRAIN_WAIT_S)
            if open_:   # a process outside the groups holds a pipe: stop reading, keep what we have
                for transport in self._transports:
                    transport.close()
                await asyncio.wait(open_, timeout=_DRAIN_WAIT_S)

    def _watch_heartbeat(self, fd: int, local_rank: int) -> None:
        os.set_blocking(fd, False)
        self._heartbeat_fds.append(fd)
        loop = asyncio.get_running_loop()

        def readable() -> None:
            try:
                data = os.read(fd, 4096)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:            # the worker (and every copy of its end) is gone
                loop.remove_reader(fd)
                return
            if self._on_beat is not None:
                self._on_beat(local_rank)

        loop.add_reader(fd, readable)

    def _close_heartbeats(self) -> None:
        loop = asyncio.get_running_loop()
        for fd in self._heartbeat_fds:
            loop.remove_reader(fd)
            os.close(fd)
        self._heartbeat_fds.clear()

    def _signal_groups(self, sig: int) -> None:
        for pgid in list(self._groups):
            if not self._killpg(pgid, sig):
                self._groups.discard(pgid)

    @staticmethod
    def _killpg(pgid: int, sig: int) -> bool:
        try:
            os.killpg(pgid, sig)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:   # a member changed user: it is out of our reach either way
            return False


def read_error_file(path: str) -> tuple[str, str, float] | None:
    """(message, traceback, unix timestamp) from a torch `@record` error.json, or None."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            data = json.load(f)
        body = data["message"]
        if isinstance(body, str):   # some writers put a plain string here
            return body, "", os.path.getmtime(path)
        if not isinstance(body, dict):
            return None
        extra = body.get("extraInfo") or {}
        raw_ts = extra.get("timestamp") if isinstance(extra, dict) else None
        try:
            ts = float(raw_ts) if raw_ts is not None else os.path.getmtime(path)
        except (TypeError, ValueError):
            ts = os.path.getmtime(path)
        tb = extra.get("py_callstack", "") if isinstance(extra, dict) else ""
        return str(body.get("message", "")), str(tb or ""), ts
    except (OSError, ValueError, KeyError, TypeError):
        return None

