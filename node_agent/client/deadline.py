"""`deadline(seconds)`: `async with` a time limit raising TimeoutError, without a task of its own:
`asyncio.timeout` (3.11+), else cancelling the task at the deadline. Not `asyncio.wait_for`: before 3.12 it
makes a task per call, a cost a fleet's path checks pay all at once."""
from __future__ import annotations

import asyncio
from typing import Any


class _Deadline:
    def __init__(self, seconds: float) -> None:
        self.seconds, self.fired = seconds, False
        self.handle: asyncio.TimerHandle | None = None

    async def __aenter__(self) -> None:
        task = asyncio.current_task()
        assert task is not None, "deadline() is used inside a task"
        self.handle = asyncio.get_running_loop().call_later(self.seconds, self._fire, task)

    def _fire(self, task: asyncio.Task[Any]) -> None:
        self.fired = True
        task.cancel()

    async def __aexit__(self, kind: object, *_: object) -> None:
        if self.handle is not None:
            self.handle.cancel()
        if self.fired and kind is asyncio.CancelledError:
            raise asyncio.TimeoutError


deadline: Any = getattr(asyncio, "timeout", _Deadline)
