"""Sources of the agent's facts: tasks that put what they learn on its queue (the I/O the pure core avoids)."""
from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from node_agent.core.facts import Put


def start_source(work: Coroutine[Any, Any, None], put: Put) -> asyncio.Task[None]:
    """Run `work` (which puts facts) as a task whose unexpected failure reaches the loop."""
    def done(task: asyncio.Task[None]) -> None:
        error = None if task.cancelled() else task.exception()
        if error is not None:
            put(error)

    task = asyncio.create_task(work)
    task.add_done_callback(done)
    return task
