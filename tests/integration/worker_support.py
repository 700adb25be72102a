"""What the process-layer tests share: launches of small Python programs, a console that records
what it was given (and can be awaited for a line), and clean-up of every process a test made."""
from __future__ import annotations

import asyncio
import io
import os
import signal
import sys
import textwrap

from node_agent.workers.launch import WorkerLaunch
from node_agent.workers.output import Console

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIMIT = 30.0   # upper bound for anything awaited here; a hang fails the test instead of stalling CI


class RecordingConsole(Console):
    """A console writing to memory, which a test can await a line from."""

    def __init__(self) -> None:
        self.out, self.err = io.StringIO(), io.StringIO()
        super().__init__(self.out, self.err)
        self._watch: list[tuple[str, asyncio.Future[str]]] = []

    def write(self, stream: str, writer: object, prefix: str, text: str, *, ends_line: bool) -> None:
        super().write(stream, writer, prefix, text, ends_line=ends_line)
        for needle, fut in self._watch:
            if needle in text and not fut.done():
                fut.set_result(prefix + text)

    def lines(self, stream: str) -> list[str]:
        return (self.out if stream == "stdout" else self.err).getvalue().splitlines()

    async def seen(self, needle: str) -> str:
        for line in self.lines("stdout") + self.lines("stderr"):
            if needle in line:
                return line
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._watch.append((needle, fut))
        return await asyncio.wait_for(fut, LIMIT)


def launch(local_rank: int, code: str, *, env: dict[str, str] | None = None, log_dir: str | None = None,
           **kw: object) -> WorkerLaunch:
    """Local rank `local_rank` (global rank 10 + it) running the Python source `code`. Its console lines
    are prefixed `[h:rank N] ` (as with --log-line-prefix), so they pass through the test's console."""
    rank = 10 + local_rank
    kw = {"prefix": f"[h:rank {rank}] ", "prefix_all": True, **kw}
    return WorkerLaunch(local_rank=local_rank, rank=rank, argv=[sys.executable, "-c", textwrap.dedent(code)],
                        env={**os.environ, "LOCAL_RANK": str(local_rank), **(env or {})},
                        log_dir=log_dir, **kw)  # type: ignore[arg-type]


def kill_strays(pids: list[int]) -> None:
    """SIGKILL pids a test learned of that are not our children, if they are still there."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
