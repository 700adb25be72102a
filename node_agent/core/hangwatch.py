"""Pure hang detection: which local ranks stopped beating for longer than the timeout. No I/O.
A rank is watched only after its first beat, so scripts that never call `beat()` are never hung."""
from __future__ import annotations


class HangWatch:
    __slots__ = ("timeout_s", "last_beat")   # a misspelt attribute is an error, not a new one

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.last_beat: dict[int, float] = {}

    def beat(self, local_rank: int, now: float) -> None:
        self.last_beat[local_rank] = now

    def forget(self, local_rank: int) -> None:
        self.last_beat.pop(local_rank, None)

    def reset(self) -> None:
        self.last_beat.clear()

    def next_deadline(self) -> float | None:
        return min(self.last_beat.values()) + self.timeout_s if self.last_beat else None

    def overdue(self, now: float) -> list[int]:
        """Local ranks silent for at least the timeout, the longest-silent first."""
        late = [(t, r) for r, t in self.last_beat.items() if now - t >= self.timeout_s]
        return [r for _, r in sorted(late)]
