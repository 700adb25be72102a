"""The agent's console (its stdout and stderr), written without ever blocking the agent.

Rule: a console nobody reads (a wrapper that stopped reading, a stuck `tee`) costs console lines, never a
blocked agent: a blocking write in the event loop would stop its heartbeats and its leases would lapse. So
each stream has a bounded buffer (LIMIT bytes) that a daemon thread writes out with blocking writes. When
the buffer is full, whole lines are dropped and counted; once the console took everything, one line says
how many. At exit what is buffered gets EXIT_FLUSH_S at most, and a count still unsaid goes to the other
stream. The thread writes at most PIPE_BUF bytes at a time, cut after a newline: such a write to a pipe is
all or nothing, so a write still blocked when the agent exits leaves no half line behind.

Workers get the console itself only where it cannot block them (`hands_over`); see workers/output.py.
"""
from __future__ import annotations

import atexit
import os
import select
import stat
import sys
import threading
import time
from typing import Protocol, TextIO

LIMIT = 1 << 20          # bytes buffered per stream before lines are dropped
SLACK = 64 * 1024        # more for the rest of a line already started, so it is not cut (past it, it is)
CHUNK = select.PIPE_BUF  # bytes per write: atomic on a pipe
EXIT_FLUSH_S = 1.0       # what the buffers get at exit; a notice to the other stream gets as long again


class Out(Protocol):
    def write(self, text: str) -> None: ...


class ConsoleWriter:
    """One file descriptor's writer. `write` never blocks (beyond a lock held for a buffer copy)."""

    def __init__(self, fd: int, name: str = "stdout", *, limit: int = LIMIT, slack: int = SLACK,
                 label: str = "node-agent") -> None:
        self.fd = fd
        self.name = name                     # "stdout" or "stderr", for the notice
        self.label = label                   # the notice's "[label]"
        self.limit, self.slack = limit, slack
        self.dropped = 0                     # lines dropped since the start
        self.unsaid = 0                      # of them, not yet said
        self.broken = False                  # the console is gone (EPIPE, closed): everything is dropped
        self._buf = bytearray()              # accepted, not yet written
        self._writing = 0                    # bytes taken by the thread, not yet written
        self._chunk = b""                    # those bytes
        self._src_start = True               # the caller's next byte starts a line
        self._dropping = False               # the caller's current line is being dropped
        self._open = False                   # what was accepted ends inside a line (no notice then)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def write(self, text: str) -> None:
        """Queue `text` (whole lines, or a piece of one); drop the lines that do not fit."""
        data = text.encode("utf-8", "replace")
        with self._cond:
            if self.broken:
                return
            *lines, rest = data.split(b"\n")
            for line in lines:
                self._piece(line + b"\n")
            if rest:
                self._piece(rest)
            if self._buf:
                self._start()
                self._cond.notify_all()
            if not self._writing and not self._buf:
                self._notice_if_drained()

    def _piece(self, piece: bytes) -> None:
        """A line, or a piece of one, ending at its newline if it has one."""
        ends = piece.endswith(b"\n")
        held = len(self._buf) + self._writing
        if self._dropping:                       # the rest of a dropped line: counted already
            self._dropping = not ends
        elif held + len(piece) <= self.limit + (0 if self._src_start else self.slack):
            self._buf += piece                   # a line, or the rest of one already (partly) queued
            self._open = not ends
        else:                                    # a new line, or the rest of one past the slack
            self.dropped += 1
            self.unsaid += 1
            self._dropping = not ends
            if self._open:                       # a line that long is shown cut (and counted): end it here
                self._buf += b"\n"
                self._open = False
        self._src_start = ends

    def _notice_if_drained(self) -> None:
        """Once the console took everything (and no line is half written), say what was dropped."""
        if self.unsaid and not self._open:
            text = notice(self.label, self.unsaid, self.name)
            self.unsaid = 0
            self._buf += text.encode()
            self._start()
            self._cond.notify_all()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"console-{self.name}", daemon=True)
            self._thread.start()
            _writers.append(self)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._buf and not self.broken:
                    self._cond.wait()
                if self.broken:
                    return
                n = min(len(self._buf), CHUNK)
                if n < len(self._buf):               # cut after the last whole line that fits
                    n = self._buf.rfind(b"\n", 0, n) + 1 or n
                chunk = self._chunk = bytes(self._buf[:n])
                del self._buf[:n]
                self._writing = n
            ok = self._write_out(chunk)
            with self._cond:
                self._writing, self._chunk = 0, b""
                if not ok:
                    self.broken = True
                    self._buf.clear()
                elif not self._buf:
                    self._notice_if_drained()
                self._cond.notify_all()

    def _write_out(self, chunk: bytes) -> bool:
        """Blocking writes of `chunk`; False when the console is gone."""
        view = memoryview(chunk)
        while view:
            try:
                view = view[os.write(self.fd, view):]
            except BlockingIOError:              # someone set O_NONBLOCK on the shared file: wait for room
                select.select([], [self.fd], [])
            except OSError:                      # EPIPE, EBADF, EIO: nobody will read this console again
                return False
        return True

    def flush(self, timeout: float) -> bool:
        """Wait at most `timeout` seconds until everything queued was written; True when it was."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (self._buf or self._writing) and not self.broken:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self) -> None:
        """Stop: drop what is queued, and wait (a little) for a write under way; the fd is then the caller's
        to close. A write blocked on a pipe ends when its reader closes it."""
        with self._cond:
            self.broken = True
            self._buf.clear()
            self._cond.notify_all()
            end = time.monotonic() + EXIT_FLUSH_S
            while self._writing and time.monotonic() < end:
                self._cond.wait(end - time.monotonic())

    def abandon(self) -> int:
        """Give up on what is still queued: the lines dropped and unsaid, plus those never written."""
        with self._cond:
            lost = self.unsaid + (self._chunk + self._buf).count(b"\n")
            self.unsaid = 0
            self.broken = True
            self._buf.clear()
            self._cond.notify_all()
            return lost


def notice(label: str, count: int, name: str, *, at_exit: bool = False) -> str:
    when = "was not read" if not at_exit else "was still not read at exit"
    return (f"[{label}] {count} console line{'s' if count != 1 else ''} dropped while the console's {name} {when} "
            f"(worker log files are complete)\n")


_writers: list[ConsoleWriter] = []            # those with a thread, flushed at exit
_agent: dict[str, ConsoleWriter] = {}          # the agent's own stdout and stderr
_label = ["node-agent"]


class _Passthrough:
    """A stream someone replaced sys.stdout/sys.stderr with (a test's capture): written to as it is."""

    def __init__(self, stream: TextIO | None) -> None:
        self._stream = stream

    def write(self, text: str) -> None:
        if self._stream is None:          # no console at all (sys.stdout is None)
            return
        try:
            self._stream.write(text)
            self._stream.flush()
        except (OSError, ValueError):
            pass


def agent_console(name: str) -> Out:
    """The agent's "stdout" or "stderr", written through a ConsoleWriter (a stream that replaced
    sys.stdout/sys.stderr, as a test's capture does, is written to directly)."""
    current, original = (sys.stdout, sys.__stdout__) if name == "stdout" else (sys.stderr, sys.__stderr__)
    if current is not original or current is None:
        return _Passthrough(current)
    writer = _agent.get(name)
    if writer is None:
        try:
            fd = current.fileno()
        except (OSError, ValueError, AttributeError):
            return _Passthrough(current)
        writer = _agent[name] = ConsoleWriter(fd, name, label=_label[0])
    return writer


def set_label(label: str) -> None:
    """What the agent's notices start with, e.g. "node-agent a"."""
    _label[0] = label
    for writer in _agent.values():
        writer.label = label


def hands_over(fd: int) -> bool:
    """Whether a worker may get this console fd itself: a terminal, /dev/null or a regular file (its
    writes do not wait on a reader). A pipe, socket or FIFO can fill and block the worker: no."""
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return False
    return stat.S_ISREG(mode) or stat.S_ISCHR(mode)


def _same_file(a: int, b: int) -> bool:
    try:
        sa, sb = os.fstat(a), os.fstat(b)
    except OSError:
        return True
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


@atexit.register
def flush_at_exit() -> None:
    """Write what is buffered, EXIT_FLUSH_S at most in all. When the agent's stdout or stderr is stuck, what
    it lost is said on the other one, if that is another file, with as long again at most."""
    deadline = time.monotonic() + EXIT_FLUSH_S
    stuck = [w for w in _writers if not w.flush(max(0.0, deadline - time.monotonic()))]
    for w in stuck:
        if w not in _agent.values():
            continue
        other_name = "stderr" if w.name == "stdout" else "stdout"
        other = agent_console(other_name)
        lost = w.abandon()
        if lost and isinstance(other, ConsoleWriter) and other not in stuck and not _same_file(w.fd, other.fd):
            other.write(notice(w.label, lost, w.name, at_exit=True))
            other.flush(EXIT_FLUSH_S)
