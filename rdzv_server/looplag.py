"""How far behind the server runs: how late its event loop runs a timer, whether connections wait in
its listening sockets' accept queues, and how long the requests it handles had waited (`note_waited`).
All three count: a loop busy with a storm of requests can run its timers on time while connections
and requests wait seconds; leases wait out the server's own lateness (coordinator.py)."""
from __future__ import annotations

import asyncio
import socket
import time

from rdzv_server import tcp_info

INTERVAL_S = 0.05
ACCEPT_WAIT_S = 1.0      # connections waiting to be accepted: the server counts as at least this far behind


class LoopLagMeter:
    """Wakes every INTERVAL_S and records how much later than asked it woke."""

    RECENT_S = 5.0           # `recent_s` is the worst lag seen this long back

    def __init__(self) -> None:
        self.samples = 0
        self.max_s = 0.0
        self.total_s = 0.0
        self._recent: list[tuple[float, float]] = []   # (when, lag) of the lags worth noting, oldest first
        self._last_wake: float | None = None            # monotonic time the meter last ran
        self._task: asyncio.Task[None] | None = None
        self._listeners: list[socket.socket] = []

    def watch_listener(self, sock: socket.socket) -> None:
        """Count connections waiting in `sock`'s accept queue as the server being behind."""
        self._listeners.append(sock)

    def accept_queue(self) -> int:
        """Connections the kernel holds for the server, not yet accepted (0 where it cannot say)."""
        infos = (tcp_info.read(sock) for sock in self._listeners)
        return sum(info.unacked for info in infos if info is not None)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="rdzv-loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            t0 = time.perf_counter()
            self._last_wake = time.monotonic()
            await asyncio.sleep(INTERVAL_S)      # the measurement itself, not a synchronisation wait
            lag = max(0.0, time.perf_counter() - t0 - INTERVAL_S)
            self.samples += 1
            self.total_s += lag
            self.max_s = max(self.max_s, lag)
            if lag >= INTERVAL_S:
                self._note(time.monotonic(), lag)

    def note_waited(self, waited_s: float) -> None:
        """A request handled now had waited `waited_s` since its kernel received it: the server is that far behind."""
        if waited_s >= INTERVAL_S:
            self._note(time.monotonic(), waited_s)

    def _note(self, now: float, lag: float) -> None:
        # one entry per INTERVAL_S at most (its worst): thousands of requests a second each note a wait
        if self._recent and now - self._recent[-1][0] < INTERVAL_S:
            if lag > self._recent[-1][1]:
                self._recent[-1] = (self._recent[-1][0], lag)
            return
        self._recent.append((now, lag))

    def recent_s(self) -> float:
        """How far behind the server has run lately (seconds), at least ACCEPT_WAIT_S while connections
        wait to be accepted. A stall still in progress counts too: a caller may run before the meter does."""
        now = time.monotonic()
        while self._recent and self._recent[0][0] < now - self.RECENT_S:
            self._recent.pop(0)
        ongoing = now - self._last_wake - INTERVAL_S if self._last_wake is not None else 0.0
        queued = ACCEPT_WAIT_S if self._listeners and self.accept_queue() else 0.0
        return max([ongoing, queued, *(lag for _, lag in self._recent)])

    def summary(self) -> str:
        mean = self.total_s / self.samples if self.samples else 0.0
        return f"event loop lag max {self.max_s * 1000:.1f} ms, mean {mean * 1000:.2f} ms over {self.samples} samples"
