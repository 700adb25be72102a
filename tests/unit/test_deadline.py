"""`deadline` (node_agent/client/deadline.py): asyncio.timeout where Python has it, and the 3.10 fallback
tested here on any Python: a body past its deadline raises TimeoutError, one within it is left alone, and
a cancel from outside stays a cancel."""
from __future__ import annotations

import asyncio

import pytest

from node_agent.client.deadline import _Deadline, deadline


@pytest.mark.parametrize("limit", [_Deadline, deadline])
async def test_a_body_past_its_deadline_raises_timeout(limit):
    never = asyncio.Event()
    with pytest.raises(asyncio.TimeoutError):
        async with limit(0.01):
            await never.wait()


@pytest.mark.parametrize("limit", [_Deadline, deadline])
async def test_a_body_within_its_deadline_is_left_alone(limit):
    async with limit(60):
        value = await asyncio.sleep(0, result=7)
    assert value == 7


@pytest.mark.parametrize("limit", [_Deadline, deadline])
async def test_a_cancel_from_outside_stays_a_cancel(limit):
    inside = asyncio.Event()

    async def body() -> None:
        async with limit(60):
            inside.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(body())
    await inside.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
