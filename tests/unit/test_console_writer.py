"""The agent's console writer (node_agent/workers/console.py): writes never block the caller, whole lines are dropped
and counted when the console is not read, and the count is said once the console drained; workers get the
console fd itself only where it cannot block them.

The pipes here are real. A "full" pipe is filled to its last byte before the writer gets it, so the writer's
first write blocks at once and what it holds is exactly what it accepted: the drop decisions are exact."""
from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from node_agent.workers.console import ConsoleWriter, hands_over, notice

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIMIT_S = 30.0     # a bound on anything awaited: a hang fails the test


class StuckPipe:
    """A pipe filled to the brim; the test reads it (drains it) when it chooses."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe()
        flags = fcntl.fcntl(self.w, fcntl.F_GETFL)
        fcntl.fcntl(self.w, fcntl.F_SETFL, flags | os.O_NONBLOCK)
        self.filler = 0
        for size in (4096, 1):
            while True:
                try:
                    self.filler += os.write(self.w, b"#" * size)
                except BlockingIOError:
                    break
        fcntl.fcntl(self.w, fcntl.F_SETFL, flags)     # the writer gets a blocking fd, as a console is
        self.seen = b""
        self._skip = self.filler

    def read_until(self, needle: bytes) -> bytes:
        """Drain the pipe (the filler first, not kept) until `needle` was read; returns what was read."""
        deadline = time.monotonic() + LIMIT_S
        while needle not in self.seen:
            left = deadline - time.monotonic()
            assert left > 0, f"{needle!r} never came; read: {self.seen[-300:]!r}"
            if select.select([self.r], [], [], left)[0]:
                data = os.read(self.r, 1 << 16)
                assert data, f"the pipe closed before {needle!r}; read: {self.seen[-300:]!r}"
                cut = min(self._skip, len(data))
                self._skip -= cut
                self.seen += data[cut:]
        return self.seen


@pytest.fixture
def stuck() -> Iterator[Stuck]:
    pipe, writers = StuckPipe(), list[ConsoleWriter]()
    try:
        yield pipe, writers
    finally:
        os.close(pipe.r)              # a write blocked on it fails (EPIPE): the writer's thread ends
        for writer in writers:
            writer.close()
        os.close(pipe.w)


Stuck = tuple[StuckPipe, list[ConsoleWriter]]


def writer_on(stuck: Stuck, **kw: int) -> ConsoleWriter:
    pipe, writers = stuck
    writer = ConsoleWriter(pipe.w, "stdout", label="node-agent a", **kw)
    writers.append(writer)
    return writer


def test_a_full_console_drops_whole_lines_counts_them_and_says_so_once_it_drained(stuck: Stuck) -> None:
    pipe, _ = stuck
    w = writer_on(stuck, limit=100, slack=50)
    w.write("a" * 40 + "\n")                 # 41 bytes held
    w.write("b" * 40 + "\n")                 # 82
    w.write("c" * 40 + "\n")                 # 123 > 100: dropped
    w.write("d" * 10)                        # 92: a line started...
    w.write("e" * 40 + "\n")                 # ...goes on past the limit (within the slack): never half a line
    w.write("f\n")                           # dropped
    w.write("g" * 10)                        # a line dropped at its start...
    w.write("h\n")                           # ...is dropped to its end (counted once)
    assert (w.dropped, w.unsaid) == (3, 3)
    said = notice("node-agent a", 3, "stdout").encode()
    got = pipe.read_until(said)
    assert got == b"a" * 40 + b"\n" + b"b" * 40 + b"\n" + b"d" * 10 + b"e" * 40 + b"\n" + said
    assert said == b"[node-agent a] 3 console lines dropped while the console's stdout was not read " \
                   b"(worker log files are complete)\n"
    assert w.flush(LIMIT_S)
    w.write("i\n")                            # after the drain: written, and nothing said again
    assert pipe.read_until(b"i\n") == got + b"i\n"
    assert w.flush(LIMIT_S) and (w.dropped, w.unsaid) == (3, 0)


def test_a_line_past_the_slack_is_cut_there_ended_and_counted(stuck: Stuck) -> None:
    pipe, _ = stuck
    w = writer_on(stuck, limit=20, slack=10)
    w.write("x" * 15)                         # started: 15 held
    w.write("y" * 10)                         # 25: within the slack
    w.write("z" * 10)                         # 35 > 30: the line is ended here, its rest dropped (one line)
    w.write("w\n")
    assert (w.dropped, w.unsaid) == (1, 1)
    said = notice("node-agent a", 1, "stdout").encode()
    assert pipe.read_until(said) == b"x" * 15 + b"y" * 10 + b"\n" + said
    assert w.flush(LIMIT_S)
    w.write("next\n")
    assert pipe.read_until(b"next\n") == b"x" * 15 + b"y" * 10 + b"\n" + said + b"next\n"


def test_writes_to_a_console_nobody_reads_return_and_every_line_is_written_or_counted(stuck: Stuck) -> None:
    pipe, _ = stuck
    w = writer_on(stuck, limit=64 * 1024)
    total = 100_000                            # about 1.5 MB: the pipe and the buffer many times over

    def chatter() -> None:
        for i in range(total):
            w.write(f"line {i}\n")

    writing = threading.Thread(target=chatter, daemon=True)
    writing.start()
    writing.join(LIMIT_S)
    assert not writing.is_alive(), "a write blocked on the unread console"
    assert 90_000 < w.dropped < total
    said = notice("node-agent a", w.dropped, "stdout").encode()
    lines = pipe.read_until(said).decode().splitlines()
    assert lines[-1] + "\n" == said.decode()
    shown = [int(m.group(1)) for m in (re.fullmatch(r"line (\d+)", line) for line in lines[:-1]) if m]
    assert len(shown) == len(lines) - 1                  # whole lines only
    assert shown == sorted(shown) and len(shown) + w.dropped == total


def test_a_console_that_went_away_is_dropped_without_an_error(stuck: Stuck) -> None:
    pipe, _ = stuck
    w = writer_on(stuck)
    w.write("lost\n")
    os.close(pipe.r)
    pipe.r = os.open(os.devnull, os.O_RDONLY)    # for the fixture to close
    assert w.flush(LIMIT_S) and w.broken         # the blocked write failed with EPIPE
    w.write("after\n")                           # a no-op, no exception
    assert w.flush(0) and w.broken


def test_flush_gives_up_on_a_stuck_console_after_its_timeout(stuck: Stuck) -> None:
    """It gives up (False) on a console still stuck, and meanwhile waits: a flush under way when the console is
    read returns True. What is shown is what it did, not how long it took (a loaded host stretches any time)."""
    pipe, _ = stuck
    w = writer_on(stuck)
    w.write("held\n")
    assert not w.flush(0.2)
    done: list[bool] = []
    waiting = threading.Thread(target=lambda: done.append(w.flush(LIMIT_S)), daemon=True)
    waiting.start()
    assert waiting.is_alive() and not done              # the console is still stuck: it waits
    pipe.read_until(b"held\n")
    waiting.join(LIMIT_S)
    assert done == [True]


EXITING = """
import sys
from node_agent.workers.console import agent_console, set_label
set_label("node-agent a")
out = agent_console("stdout")
for i in range(200_000):
    out.write(f"line {i}\\n")
agent_console("stderr").write("bye\\n")
"""


def test_the_agent_exits_at_once_on_a_stuck_stdout_and_says_what_it_lost_on_stderr() -> None:
    r, w = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-c", EXITING], stdout=w, stderr=subprocess.PIPE,
                                env=dict(os.environ, PYTHONPATH=ROOT))
        try:
            _, err = proc.communicate(timeout=LIMIT_S)    # stderr is read; stdout is not
        finally:
            proc.kill()
            proc.wait()
        assert proc.returncode == 0                     # within LIMIT_S, its stdout never read
        said = err.decode().splitlines()
        assert said[0] == "bye" and len(said) == 2, said
        m = re.fullmatch(r"\[node-agent a\] (\d+) console lines dropped while the console's stdout was still not "
                         r"read at exit \(worker log files are complete\)", said[1])
        assert m is not None, said[1]
        os.close(w)
        w = -1
        data = b""
        while chunk := os.read(r, 1 << 16):           # what did reach the pipe: whole lines, in order
            data += chunk
        lines = data.decode().splitlines()
        assert data.endswith(b"\n") and lines == [f"line {i}" for i in range(len(lines))]
        assert len(lines) + int(m.group(1)) == 200_000
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_workers_get_the_console_itself_only_where_it_cannot_block_them(tmp_path: Path) -> None:
    r, w = os.pipe()
    a, b = socket.socketpair()
    master, slave = pty.openpty()
    devnull = os.open(os.devnull, os.O_WRONLY)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    fifo_r = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    fifo_w = os.open(fifo, os.O_WRONLY)
    try:
        with open(tmp_path / "file", "w") as f:
            assert hands_over(f.fileno()) and hands_over(slave) and hands_over(devnull)
        assert not hands_over(w) and not hands_over(a.fileno()) and not hands_over(fifo_w)
    finally:
        for fd in (r, w, master, slave, devnull, fifo_r, fifo_w):
            os.close(fd)
        a.close()
        b.close()
