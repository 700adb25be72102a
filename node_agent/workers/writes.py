"""Snapshot writes under way in a round's memory directories, let end before the agent's own stop signals its
workers (an operator's restart of the agent, a Ctrl-C): a rank stopped mid-write holds only its older step, while the
ranks whose writes end (a peer node's, dying of the broken collective: the interpreter's exit waits for its writer)
hold the new one, and where the limit holds one snapshot no step is held in common: every rank of a job of shards
went back to step 0 (a review). Bounded by the stop timeout and WAIT_S, and never for a stop the job's own restart
makes (a crash's recovery does not wait on a write: the held floor keeps a step in common there). A `.tmp` there
before the workers started is a dead writer's: not waited for."""
from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Iterable

from node_agent.training import snapshot

WAIT_S = 5.0            # the most a stop waits for writes under way


def stop_bound(stop_timeout: float) -> float:
    """The most the agent's own stop takes before SIGKILL: the writes' wait, then --stop-timeout (what its leave
    tells the server: LeaveRequest.stop_timeout_s)."""
    return min(stop_timeout, WAIT_S) + stop_timeout


class Writes:
    def __init__(self, dirs: Iterable[str | None]) -> None:
        """`dirs`: the round's memory directories, as its workers start."""
        self._stale = _under_way(dirs)          # a writer's that died earlier: no worker of this round ends them

    async def ended(self, running: Callable[[], Iterable[str | None]], limit: float) -> None:
        """Until the writes under way in the directories of the workers `running()` (begun since the round started)
        ended, or their writers did, at most `limit` seconds (and WAIT_S)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(limit, WAIT_S)
        # Those under way now, not a moment with none: a writer whose next snapshot begins as its last ends leaves
        # none (a review: every such stop took the whole cap, and signalled mid-write all the same)
        begun = _files(_under_way(running()) - self._stale)
        while begun & _files(_under_way(running())) and loop.time() < deadline:  # noqa: ASYNC110  (another process's
            await asyncio.sleep(0.01)        # rename: nothing tells the agent of it, so it is polled)


def _files(found: set[tuple[str, int, int]]) -> set[tuple[str, int]]:
    """path and inode: a file's mtime moves while it is written."""
    return {(path, ino) for path, ino, _ in found}


def _under_way(dirs: Iterable[str | None]) -> set[tuple[str, int, int]]:
    """path, inode, mtime of each write under way in `dirs`."""
    found = set()
    for where in {d for d in dirs if d}:
        for name in snapshot.unfinished(where):
            with contextlib.suppress(OSError):
                st = os.stat(os.path.join(where, name))
                found.add((os.path.join(where, name), st.st_ino, st.st_mtime_ns))
    return found
