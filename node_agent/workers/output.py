"""Where a worker's output goes: its log files and the agent's console, as torchrun sends it.

- Console only, unprefixed, and the console a terminal, /dev/null or a file: the worker gets the agent's console
  itself, so `isatty()`, colours, progress bars and `breakpoint()` behave as in `python train.py`.
- Else through a pipe the agent reads: files get the bytes as written (as torchrun's worker writes its file, not
  valid UTF-8 too); the console each line whole, prefixed (again after `\\r`, for progress bars), a partial line
  after FLUSH_DELAY_S; lines of two ranks never mix.
- A worker must never block on its output: a failing log file (disk full) is dropped, said once; a console
  that is a pipe, socket or FIFO is never handed to a worker (nobody may read it), and the agent writes
  to its console through node_agent/workers/console.py, which drops (and counts) lines rather than wait.
"""
from __future__ import annotations

import asyncio
import codecs
import contextlib
import io
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO, TextIO

from node_agent.settings import Std
from node_agent.workers.console import agent_console, hands_over
from node_agent.workers.launch import WorkerLaunch

MAX_PIECE = 64 * 1024          # a line longer than this without a newline is passed on in pieces
FLUSH_DELAY_S = 0.05           # a partial line shows after this long without its end
STREAMS = (("stdout", Std.OUT), ("stderr", Std.ERR))
_REDRAW = re.compile(r"\r(?=[^\n])")    # a carriage return that starts a redrawn line


class Console:
    """Where echoed worker output goes: the agent's stdout and stderr (never blocking: node_agent/workers/console.py)
    unless given other streams (tests), which are written to as they are."""

    def __init__(self, out: TextIO | None = None, err: TextIO | None = None) -> None:
        self._out = out
        self._err = err
        self._broken: set[str] = set()
        self._open: dict[str, object] = {}    # stream -> the writer whose line is unfinished

    def _target(self, stream: str) -> TextIO:
        return (self._out or sys.stdout) if stream == "stdout" else (self._err or sys.stderr)

    def fileno(self, stream: str) -> int | None:
        """The file descriptor behind `stream`, for a worker to write to directly (None: there is none)."""
        try:
            return self._target(stream).fileno()
        except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
            return None

    def line(self, stream: str, text: str) -> None:
        """Write one full line (no newline in `text`) to "stdout" or "stderr"."""
        self.write(stream, self, "", text, ends_line=True)

    def write(self, stream: str, writer: object, prefix: str, text: str, *, ends_line: bool) -> None:
        """Write `writer`'s text, a whole line (`ends_line`) or a piece of one, in one write."""
        if stream in self._broken:
            return
        parts = []
        owner = self._open.get(stream)
        if owner is not None and owner is not writer:   # end another writer's unfinished line first
            parts.append("\n")
            owner = None
        if owner is None:
            parts.append(prefix)
        parts.append(_REDRAW.sub(lambda _: "\r" + prefix, text) if prefix else text)
        if ends_line:
            parts.append("\n")
            self._open.pop(stream, None)
        else:
            self._open[stream] = writer
        given = self._out if stream == "stdout" else self._err
        if given is None:
            agent_console(stream).write("".join(parts))   # one write: a line stays whole with other writers
            return
        try:
            given.write("".join(parts))
            given.flush()
        except (OSError, ValueError):      # closed or broken console: keep logging to files, drop echo
            self._broken.add(stream)

    def end(self, stream: str, writer: object) -> None:
        """`writer` writes no more: end its unfinished line, so that the next line (the agent's own, or a
        later worker's) starts a line of its own instead of running on after a worker's last partial line."""
        if self._open.get(stream) is writer:
            self.write(stream, writer, "", "", ends_line=True)


@dataclass
class Sink:
    """One stream's destinations: a log file, the console (through `echo`), a filtered copy, or the
    console itself handed to the worker (`direct`: a file descriptor, or subprocess.DEVNULL)."""
    file: BinaryIO | None
    echo: Callable[[str, bool], None] | None       # (text, ends_line)
    filtered: Callable[[str], None] | None = None  # a whole line that may go to filtered_*.log
    direct: int | None = None
    end: Callable[[], None] | None = None          # the stream ended: finish a partial line on the console

    def close(self) -> None:
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.close()


def open_sink(launch: WorkerLaunch, stream: str, std: Std, console: Console) -> Sink:
    """`stream` ("stdout"/"stderr") of one worker, routed by its redirect/tee/echo settings."""
    file: BinaryIO | None = None
    logged = launch.log_dir is not None and bool((launch.redirect | launch.tee) & std)
    tee = logged and bool(launch.tee & std)
    on_console = launch.echo and (tee or not logged)
    prefix = launch.prefix if (tee or launch.prefix_all) else ""
    filters = (launch.dup_stdout if stream == "stdout" else launch.dup_stderr) if tee and launch.echo else ()
    if on_console and not logged and not prefix:
        fd = console.fileno(stream)
        if fd is not None and hands_over(fd):
            return Sink(None, None, direct=fd)     # torchrun's console: the worker writes to it itself
        # A pipe or socket (or no fd): read by the agent, so a console nobody reads costs lines, not the worker
    if not on_console and not logged:
        return Sink(None, None, direct=subprocess.DEVNULL)
    if logged:
        assert launch.log_dir is not None
        os.makedirs(launch.log_dir, exist_ok=True)
        # Append: a directory reused by a later round keeps the earlier output.
        file = open(os.path.join(launch.log_dir, f"{stream}.log"), "ab")   # flushed per read (data_received)
    echo: Callable[[str, bool], None] | None = None
    end: Callable[[], None] | None = None
    if on_console:
        def echo(text: str, ends_line: bool) -> None:
            console.write(stream, echo, prefix, text, ends_line=ends_line)

        def end_line() -> None:
            console.end(stream, echo)
        end = end_line
    filtered = None
    if filters and launch.attempt_dir is not None:
        path = os.path.join(launch.attempt_dir, f"filtered_{stream}.log")

        def filtered(line: str) -> None:
            if any(needle in line for needle in filters):
                # one append per line: the ranks of a node share the file
                with contextlib.suppress(OSError), open(path, "a", encoding="utf-8") as f:
                    f.write(f"{prefix}{line}\n")
    return Sink(file, echo, filtered, end=end)


class LinePump(asyncio.Protocol):
    """Reads one worker stream into its sink. `done` resolves once the pipe closed."""

    def __init__(self, sink: Sink) -> None:
        self._sink = sink
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""          # the console's unshown start of a line
        self._line = ""             # the current line as far as shown, for the filters
        self._timer: asyncio.TimerHandle | None = None
        self._loop = asyncio.get_running_loop()
        self.done: asyncio.Future[None] = self._loop.create_future()

    def data_received(self, data: bytes) -> None:
        sink = self._sink
        if sink.file is not None:
            try:   # the file gets the bytes as written, undecoded (not valid UTF-8 too), as in torchrun's file
                sink.file.write(data)
                sink.file.flush()      # buffered: a short write of the file is retried, not lost
            except OSError as e:   # disk full and the like: the worker must not block on its pipe
                file, sink.file = sink.file, None
                with contextlib.suppress(OSError):
                    file.close()
                if sink.echo is not None:
                    sink.echo(f"(log file {getattr(file, 'name', '?')} failed: {e}; not writing it)", True)
        self._feed(self._decoder.decode(data))

    def eof_received(self) -> bool:
        return False   # close the transport: connection_lost then flushes

    def connection_lost(self, exc: Exception | None) -> None:
        self._feed(self._decoder.decode(b"", final=True))
        if self._timer is not None:
            self._timer.cancel()
        self._show_pending()
        if self._sink.end is not None:
            self._sink.end()
        if self._line and self._sink.filtered is not None:
            self._sink.filtered(self._line)
        self._sink.close()
        if not self.done.done():
            self.done.set_result(None)

    def _feed(self, text: str) -> None:
        if not text:
            return
        *lines, self._pending = (self._pending + text).split("\n")
        for line in lines:
            self._show(line, ends_line=True)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if len(self._pending) >= MAX_PIECE:
            self._show_pending()
        elif self._pending:
            self._timer = self._loop.call_later(FLUSH_DELAY_S, self._show_pending)

    def _show_pending(self) -> None:
        self._timer = None
        if self._pending:
            pending, self._pending = self._pending, ""
            self._show(pending, ends_line=False)

    def _show(self, text: str, *, ends_line: bool) -> None:
        sink = self._sink
        if sink.echo is not None:
            sink.echo(text, ends_line)
        if sink.filtered is not None:
            self._line += text
            if ends_line:
                line, self._line = self._line, ""
                sink.filtered(line)


async def pump(fd: int, sink: Sink) -> tuple[asyncio.ReadTransport, LinePump]:
    """Start reading the pipe `fd` (ours from now on) into `sink`."""
    pipe = os.fdopen(fd, "rb", buffering=0)
    try:
        return await asyncio.get_running_loop().connect_read_pipe(lambda: LinePump(sink), pipe)
    except BaseException:
        pipe.close()
        sink.close()
        raise
