"""The agents' c10d store for one round of the torchrun plugin: group rank 0's TCPStore under the round's own
prefix (`rdzv-server/JOB/ROUND/`), passed through, with torch's exit barrier watched (see RoundStore)."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from node_agent.plugin.torch_internals import EXIT_BARRIER, Store, store_timeout

JOB_SUCCEEDED = "job succeeded"


class RoundStore(Store):
    """The agents' store for one round: passes everything through, and watches torch's exit barrier. An agent
    enters it only when all its workers exited 0, the one sign of success torch gives: the first `add` reports it.
    The wait ends once the server says the job succeeded, even if group rank 0's agent (the store's host) has
    exited; it is abandoned when the job moves on without this node, not after torch's 5-minute barrier timeout."""

    def __init__(self, inner: Store, on_exit_barrier: Callable[[], None], barrier_over: Callable[[], str]) -> None:
        """`barrier_over()`: JOB_SUCCEEDED, why the job moved on without this node, or "" (not over)."""
        super().__init__()
        self._inner = inner
        self._on_exit_barrier = on_exit_barrier
        self._barrier_over = barrier_over
        self._timeout = store_timeout(inner)

    def set(self, key: str, value: Any) -> None:
        self._inner.set(key, value)

    def get(self, key: str) -> bytes:
        return self._inner.get(key)

    def add(self, key: str, value: int) -> int:
        if key.startswith(EXIT_BARRIER):
            self._on_exit_barrier()
        return self._inner.add(key, value)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._inner.compare_set(key, expected, desired)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._inner.multi_get(keys)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self._inner.multi_set(keys, values)   # type: ignore[attr-defined]  # missing from torch's stub

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
        self._inner.set_timeout(timeout)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if not any(k.startswith(EXIT_BARRIER) for k in keys):
            self._inner.wait(keys) if timeout is None else self._inner.wait(keys, timeout)
            return
        # Checked, not a blocking wait in slices: c10d logs two warnings for every wait that times out.
        deadline_s = (timeout or self._timeout).total_seconds()
        deadline = time.monotonic() + deadline_s
        problem = f"the other agents did not come within {deadline_s:g}s"
        for pause in pauses():
            try:
                if self._inner.check(keys):
                    return
            except dist.DistError as exc:     # rank 0's agent may be gone: the server knows how things stand
                problem = f"the round's store failed: {first_line(exc)}"
            why = self._barrier_over()
            if why == JOB_SUCCEEDED:
                return
            if why:
                raise dist.DistStoreError(f"exit barrier abandoned: {why}")
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"exit barrier: {problem}")
            time.sleep(pause)


ARRIVED_KEY, GATE_KEY = "agents_arrived", "agents_gate"
GO, VOID = "go", "void"


def all_arrived(store: Store, world: int, moved_on: Callable[[], str], timeout_s: float) -> bool:
    """Whether every agent of the round came to its store before the round moved on (False: it moved on first).
    Once next_rendezvous returns, torch's agents write their role there and block until all the others' are in,
    for the store's whole timeout: one that went on to a newer round meanwhile never writes it. So it is decided
    here first, atomically (compare_set): the last to come says go, one leaving first voids the round; all agents
    go on into torch's, or none. Raises TimeoutError (the round voided) when they do not all come in time."""
    if store.add(ARRIVED_KEY, 1) >= world:
        return store.compare_set(GATE_KEY, "", GO) == GO.encode()
    deadline = time.monotonic() + timeout_s
    for pause in pauses():
        if store.check([GATE_KEY]):
            return store.get(GATE_KEY) == GO.encode()
        late = time.monotonic() >= deadline
        if moved_on() or late:
            if store.compare_set(GATE_KEY, "", VOID) == GO.encode():
                return True
            if late:
                raise TimeoutError(f"the round's other agents did not all come within {timeout_s:g}s")
            return False
        time.sleep(pause)
    return False


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def pauses() -> Iterator[float]:
    """Pauses between checks of a store key: quick at first (it is usually there at once), then 0.2 s."""
    pause = 0.005
    while True:
        yield pause
        pause = min(0.2, pause * 2)
