"""Stand-ins the agent's tests share: a worker group whose workers end when the test says so."""
from __future__ import annotations

import asyncio
import dataclasses
import signal
from typing import Any

from node_agent.settings import AgentSettings, CheckSettings, LinkSettings, WorkerSettings
from node_agent.workers.launch import WorkerLaunch
from node_agent.workers.process import WorkerExit, signal_name

LIMIT = 10.0   # bound on anything awaited: a hang fails the test instead of stalling CI


class FakeGroup:
    """A worker group whose workers end when the test says so."""

    def __init__(self, launches: list[WorkerLaunch], *, stop_timeout: float,
                 spawn_error: OSError | None = None) -> None:
        self.launches = launches
        self.spawn_error = spawn_error
        self.stopped_with: int | None = None
        self.signals: list[int] = []
        self.warm_pids: list[int] = []          # none forked from a zygote
        self.stuck_pids: list[int] = []         # a test sets those that outlive the stop
        self._exits: list[WorkerExit] = []
        self._changed = asyncio.Event()

    @property
    def env(self) -> dict[str, str]:
        return self.launches[0].env

    async def start(self) -> None:
        if self.spawn_error is not None:
            raise self.spawn_error

    def end(self, **codes: int) -> None:
        """Workers end: `end(r0=0, r1=3)` -- local rank 0 exits 0, local rank 1 exits 3."""
        for name, code in codes.items():
            launch = self.launches[int(name[1:])]
            self._exits.append(WorkerExit(local_rank=launch.local_rank, rank=launch.rank, pid=1000 + launch.rank,
                                          exitcode=code, signal_name=signal_name(code), error_file=None,
                                          seen_at=1.0))
        self._changed.set()

    async def wait(self) -> list[WorkerExit]:
        while True:
            failed = [e for e in self._exits if e.exitcode != 0]
            if failed or len(self._exits) == len(self.launches):
                return failed or list(self._exits)
            self._changed.clear()
            await self._changed.wait()

    def exits(self) -> list[WorkerExit]:
        return list(self._exits)

    def pid_of(self, local_rank: int) -> int | None:
        return None             # no process: its progress record stays empty

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)

    async def stop(self, sig: int = signal.SIGTERM, finish_writes: bool = False) -> None:
        if self.stopped_with is None:
            self.stopped_with = sig
            ended = {e.local_rank for e in self._exits}
            self.end(**{f"r{w.local_rank}": -sig for w in self.launches if w.local_rank not in ended})


def agent_settings(**given: Any) -> AgentSettings:
    """The agent's settings with `given` fields set in every part that has them (as the CLI fills them)."""
    def part(kind: type) -> Any:
        return kind(**{f.name: given[f.name] for f in dataclasses.fields(kind) if f.name in given})
    return AgentSettings(part(WorkerSettings), part(LinkSettings), part(CheckSettings))
