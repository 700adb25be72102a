"""Where a worker's output goes: its log files and the agent's console, one whole line at a time.

- Output is decoded as UTF-8 with replacement, split into lines (a very long line goes on in pieces)
  and written whole: one write per console line, so ranks never interleave inside a line.
- A log file that fails (disk full) is dropped with one line on the console: the worker must never
  block on a full pipe because we stopped reading it.
- A console that breaks (closed terminal) is dropped; the log files go on.
"""
from __future__ import annotations

import asyncio
import codecs
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from node_agent.launch import WorkerLaunch
from node_agent.option_values import Std

MAX_PIECE = 64 * 1024          # a line longer than this without a newline is passed on in pieces
STREAMS = (("stdout", Std.OUT), ("stderr", Std.ERR))


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


@dataclass
class Sink:
    """One stream's destinations: a log file, the console (through `echo`), both or neither."""
    file: TextIO | None
    echo: Callable[[str], None] | None

    def close(self) -> None:
        if self.file is not None:
            try:
                self.file.close()
            except OSError:
                pass


def open_sink(launch: WorkerLaunch, stream: str, std: Std, console: Console) -> Sink:
    """`stream` ("stdout"/"stderr") of one worker, routed by its redirect/tee/echo settings."""
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

        def echo(text: str) -> None:
            console.line(stream, head + text)
    return Sink(file, echo)


class LinePump(asyncio.Protocol):
    """Reads one worker stream; sends each line to the sink. `done` resolves once the pipe closed."""

    def __init__(self, sink: Sink) -> None:
        self._sink = sink
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self._feed(self._decoder.decode(data))

    def eof_received(self) -> bool:
        return False   # close the transport: connection_lost then flushes

    def connection_lost(self, exc: Exception | None) -> None:
        self._feed(self._decoder.decode(b"", final=True), final=True)
        self._sink.close()
        if not self.done.done():
            self.done.set_result(None)

    def _feed(self, text: str, final: bool = False) -> None:
        *lines, self._pending = (self._pending + text).split("\n")
        for line in lines:
            self._emit(line, newline=True)
        if self._pending and (final or len(self._pending) >= MAX_PIECE):
            self._emit(self._pending, newline=False)
            self._pending = ""

    def _emit(self, line: str, *, newline: bool) -> None:
        sink = self._sink
        if sink.file is not None:
            try:   # the file gets the bytes as written: a piece of a long line gets no newline
                sink.file.write(line + "\n" if newline else line)
            except OSError as e:   # disk full and the like: the worker must not block on its pipe
                file, sink.file = sink.file, None
                if sink.echo is not None:
                    sink.echo(f"(log file {getattr(file, 'name', '?')} failed: {e}; not writing it)")
        if sink.echo is not None:
            sink.echo(line)


async def pump(fd: int, sink: Sink) -> tuple[asyncio.ReadTransport, LinePump]:
    """Start reading the pipe `fd` (ours from now on) into `sink`."""
    pipe = os.fdopen(fd, "rb", buffering=0)
    try:
        return await asyncio.get_running_loop().connect_read_pipe(lambda: LinePump(sink), pipe)
    except BaseException:
        pipe.close()
        sink.close()
        raise
