"""A console nobody reads (a wrapper that stopped reading, a stuck `tee`) costs console lines, never a blocked
worker or agent: the job finishes, log files are complete, and what reached the console is whole lines, in
order. Here the agent's stdout is a real pipe the test does not read until the agent has exited."""
from __future__ import annotations

import glob
import os
import re
import select
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil  # type: ignore[import-untyped]
import pytest

from tests.e2e.harness import child_env

pytestmark = pytest.mark.e2e

LINES = 200_000        # about 2.5 MB of stdout: a 64 KiB pipe 40 times over
CHATTY = f"""
import sys
for i in range({LINES}):
    print(f"line {{i}}")
    if i % 1000 == 0:
        print(f"err {{i}}", file=sys.stderr)
"""
EXIT_WITHIN_S = 120.0


class StuckAgent:
    """node-agent --standalone whose stdout (and stderr, unless given a file) are pipes left unread."""

    def __init__(self, tmp_path: Path, *argv: str, stderr_file: str | None = None) -> None:
        self.out_r, out_w = os.pipe()
        self.err_r, err_w = os.pipe() if stderr_file is None else (-1, os.open(stderr_file, os.O_WRONLY | os.O_CREAT))
        script = tmp_path / "chatty.py"
        script.write_text(CHATTY)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "node_agent.main", "--standalone", "--nproc", "1", *argv, str(script)],
                stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w, start_new_session=True,
                env=child_env(TMPDIR=str(tmp_path)))
        finally:
            os.close(out_w)
            os.close(err_w)
        self.known: set[int] = set()

    def wait(self) -> int:
        """The agent's exit code, while nobody reads its pipes (its workers' pids remembered for the clean-up)."""
        deadline = time.monotonic() + EXIT_WITHIN_S
        while (code := self.proc.poll()) is None:
            assert time.monotonic() < deadline, f"the agent did not exit within {EXIT_WITHIN_S}s: blocked?"
            try:
                self.known |= {c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)}
            except psutil.NoSuchProcess:
                pass
            try:
                self.proc.wait(0.5)
            except subprocess.TimeoutExpired:
                pass
        return code

    def drain(self, fd: int) -> list[str]:
        """Everything the pipe holds, once every writer closed it, as lines (the last one must be whole)."""
        data = b""
        while select.select([fd], [], [], 30)[0] and (chunk := os.read(fd, 1 << 16)):
            data += chunk
        assert not data or data.endswith(b"\n"), data[-200:]
        return data.decode().splitlines()

    def close(self) -> None:
        for pid in [self.proc.pid, *self.known]:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        self.proc.wait(10)
        for fd in (self.out_r, self.err_r):
            if fd >= 0:
                os.close(fd)


Start = Callable[..., "StuckAgent"]


@pytest.fixture
def stuck_agent(tmp_path: Path) -> Iterator[Start]:
    started: list[StuckAgent] = []

    def start(*argv: str, stderr_file: str | None = None) -> StuckAgent:
        agent = StuckAgent(tmp_path, *argv, stderr_file=stderr_file)
        started.append(agent)
        return agent

    yield start
    for agent in started:
        agent.close()


def in_order(lines: list[str], pattern: str) -> list[int]:
    """The numbers of the lines matching `pattern` (each line whole), checked to be increasing."""
    numbers = [int(m.group(1)) for m in map(re.compile(pattern).fullmatch, lines) if m]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
    return numbers


def test_tee_to_an_unread_console_the_job_finishes_and_the_log_files_hold_every_line(stuck_agent: Start,
                                                                                    tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    agent = stuck_agent("--log-dir", str(logs), "--tee", "3")      # stdout and stderr both unread
    assert agent.wait() == 0
    [out_log] = glob.glob(str(logs / "*" / "attempt_0" / "0" / "stdout.log"))
    with open(out_log) as f:
        assert f.read().splitlines() == [f"line {i}" for i in range(LINES)]
    with open(os.path.join(os.path.dirname(out_log), "stderr.log")) as f:
        assert f.read().splitlines() == [f"err {i}" for i in range(0, LINES, 1000)]
    out = agent.drain(agent.out_r)                       # now read: whole lines only, in order, some dropped
    shown = in_order(out, r"\[default0\]:line (\d+)")
    assert len(shown) == len(out) and 0 < len(shown) < LINES
    err = agent.drain(agent.err_r)
    assert all(line.startswith(("[default0]:err ", "[node-agent ")) for line in err), err


def test_a_worker_alone_on_an_unread_console_is_not_blocked_and_the_lost_lines_are_counted(stuck_agent: Start,
                                                                                         tmp_path: Path) -> None:
    said = tmp_path / "agent.err"                        # the agent's stderr: a file, read after it exited
    agent = stuck_agent(stderr_file=str(said))           # console only, unprefixed: the worker's own stdout
    assert agent.wait() == 0
    out = agent.drain(agent.out_r)
    shown = in_order(out, r"line (\d+)")
    assert len(shown) == len(out) and 0 < len(shown) < LINES      # not handed the pipe: it would have blocked
    notices = [m for m in map(re.compile(r"\[node-agent [^]]+\] (\d+) console lines dropped while the console's "
                                         r"stdout was still not read at exit \(worker log files are complete\)")
                              .fullmatch, said.read_text().splitlines()) if m]
    assert len(notices) == 1, said.read_text()
    assert len(shown) + int(notices[0].group(1)) == LINES   # every line written or counted
