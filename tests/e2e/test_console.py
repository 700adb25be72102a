"""The agent on a terminal, as a person runs it: the worker gets the terminal (breakpoint() works, a
progress bar's \\r updates show at once), with one worker and with tee'd, prefixed output of two."""
from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

import psutil
import pytest

from tests.e2e.harness import child_env

pytestmark = pytest.mark.e2e

DEBUGGEE = """
import os, sys, time
rank = os.environ["RANK"]
print(f"tty {rank} {os.isatty(0)} {os.isatty(1)}", flush=True)
if rank == "0":
    sys.stdout.write("\\rprogress 50%")
    sys.stdout.flush()
    answer = input("")            # held until the test saw the partial line and typed
    sys.stdout.write(f"\\rprogress 100% ({answer})\\n")
    value = 41
    breakpoint()                  # the test types: p value + 1, then c
    print("resumed with", value + 1, flush=True)
"""


class PtyAgent:
    """node-agent with a pseudo-terminal as its stdin, stdout and stderr."""

    def __init__(self, tmp: str, *argv: str) -> None:
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen([sys.executable, "-m", "node_agent", *argv], stdin=slave, stdout=slave,
                                     stderr=slave, env=child_env(PYTHONBREAKPOINT="pdb.set_trace", TMPDIR=tmp),
                                     start_new_session=True)
        os.close(slave)
        self.seen = b""

    def expect(self, text: str, timeout: float = 30.0) -> str:
        """Read the terminal until `text` shows; returns everything read so far."""
        deadline = time.monotonic() + timeout
        while text.encode() not in self.seen:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{text!r} never showed; the terminal got:\n{self.seen.decode(errors='replace')}")
            ready, _, _ = select.select([self.master], [], [], min(left, 0.5))
            if ready:
                try:
                    self.seen += os.read(self.master, 4096)
                except OSError:          # the agent and its workers closed the terminal
                    if self.proc.poll() is not None:
                        continue
        return self.seen.decode(errors="replace")

    def type(self, line: str) -> None:
        os.write(self.master, (line + "\n").encode())

    def close(self) -> None:
        try:
            pids = [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            pids = []
        for pid in [self.proc.pid, *pids]:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        self.proc.wait(10)
        os.close(self.master)


@pytest.fixture
def on_a_terminal(tmp_path):
    started: list[PtyAgent] = []

    def start(*argv: str) -> PtyAgent:
        agent = PtyAgent(str(tmp_path), *argv)      # killed at the end: its run directory stays there
        started.append(agent)
        return agent

    yield start
    for agent in started:
        agent.close()


@pytest.mark.parametrize("argv, prefix", [
    (["--nproc-per-node", "1"], ""),                          # torchrun's default: the worker's own terminal
    (["--nproc-per-node", "2", "--tee", "3"], "[default0]:"),  # tee'd: prefixed, through the agent
])
def test_a_worker_gets_the_terminal_for_input_breakpoint_and_progress_bars(on_a_terminal, tmp_path, argv, prefix):
    script = tmp_path / "debuggee.py"
    script.write_text(DEBUGGEE)
    agent = on_a_terminal(*argv, "--log-dir", str(tmp_path / "logs"), str(script))
    shown = agent.expect("progress 50%")          # a partial line, shown while the worker waits for input
    assert f"\r{prefix}progress 50%" in shown     # a redrawn line keeps its prefix
    assert f"{prefix}tty 0 True" in shown          # stdin is the terminal
    agent.type("typed")
    agent.expect("(Pdb)")
    agent.type("p value + 1")
    agent.expect("42")
    agent.type("c")
    shown = agent.expect("resumed with 42")        # may go on pdb's prompt line, as on a plain terminal
    assert "BdbQuit" not in shown
    assert agent.proc.wait(30) == 0, agent.expect("")
    if not prefix:
        assert "tty 0 True True" in shown          # one unprefixed worker writes to the terminal itself
