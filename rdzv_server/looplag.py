"""How far behind the server runs: how late its event loop runs a timer (a loop stalled, e.g. by disk
writes), and whether connections wait in its listening sockets' accept queues (a loop busy with a
storm of requests can run its timers on time while new connections, a node's next poll among them,
wait seconds to be accepted)."""
from __future__ import annotations

import asyncio
import socket
import struct
import time

INTERVAL_S = 0.05
ACCEPT_WAIT_S = 1.0      # connections waiting to be accepted: the server counts as at least this far behind
_TCPI_UNACKED = 24       # struct tcp_info (Linux): u32 that a listening socket fills with its accept queue's length


class LoopLagProbe:
    """Wakes every INTERVAL_S and records how much later than asked it woke."""

    RECENT_S = 5.0           # `recent_s` is the worst lag seen this long back

    def __init__(self) -> None:
        self.samples = 0
        self.max_s = 0.0
        self.total_s = 0.0
        self._recent: list[tuple[float, float]] = []   # (when, lag) of the lags worth noting, oldest first
        self._last_wake: float | None = None            # monotonic time the probe last ran
        self._task: asyncio.Task[None] | None = None
        self._listeners: list[socket.socket] = []

    def watch_listener(self, sock: socket.socket) -> None:
        """Count connections waiting in `sock`'s accept queue as the server being behind."""
        self._listeners.append(sock)

    def accept_queue(self) -> int:
        """Connections the kernel holds for the server, not yet accepted (0 where it cannot say)."""
        waiting = 0
        for sock in self._listeners:
            try:
                waiting += struct.unpack_from("I", sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104),
                                              _TCPI_UNACKED)[0]
            except (OSError, AttributeError, struct.error):    # closed, or no TCP_INFO (not Linux)
                pass
        return waiting

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
                self._recent.append((time.monotonic(), lag))

    def recent_s(self) -> float:
        """How far behind the server has run lately (seconds): the backlog requests may wait in,
        ACCEPT_WAIT_S at least while connections wait to be accepted. A stall still in progress
        counts too (the probe has not run since): whoever asks right after a stall may run before
        the probe does."""
        now = time.monotonic()
        while self._recent and self._recent[0][0] < now - self.RECENT_S:
            self._recent.pop(0)
        ongoing = now - self._last_wake - INTERVAL_S if self._last_wake is not None else 0.0
        queued = ACCEPT_WAIT_S if self._listeners and self.accept_queue() else 0.0
        return max([ongoing, queued, *(lag for _, lag in self._recent)])

    def summary(self) -> str:
        mean = self.total_s / self.samples if self.samples else 0.0
        return f"event loop lag max {self.max_s * 1000:.1f} ms, mean {mean * 1000:.2f} ms over {self.samples} samples"
