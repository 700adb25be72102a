"""A holder's refusals in the agent's log (node_agent/copies/peers.py): each kind is news once, and a holder that
words each refusal anew (a hostile member chosen as this node's holder) does not make each one a line, nor grow
what the agent keeps without bound. The server's view still counts every refusal."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator

from node_agent.copies import wire
from node_agent.copies.peers import MAX_KINDS
from node_agent.training import snapshot
from protocol.messages import Witness
from tests.unit.test_copies_agent import agent_side, on_loopback, pushing


@contextlib.asynccontextmanager
async def hostile_holder() -> AsyncIterator[Witness]:
    """A holder on loopback that refuses every push in new words."""
    words = itertools.count()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()
        n = next(words)
        writer.write(wire.refused_line("busy " + "".join(chr(ord("a") + int(d)) for d in str(n))))
        await writer.drain()
        writer.close()

    async with on_loopback(handle) as where:
        yield where


async def test_a_holder_wording_each_refusal_anew_is_said_a_bounded_number_of_times(tmp_path):
    said: list[str] = []
    async with hostile_holder() as at:
        copies, dirs = agent_side(tmp_path, "b", said)
        pushing(copies, at, dirs)
        for where in dirs.values():
            snapshot.save(b"state", 5, where=where)
        pushes = 3 * MAX_KINDS
        for _ in range(pushes // len(dirs)):
            copies._retry_at.clear()        # tried again at once (RETRY_S later, in the agent)
            await copies._scan()
    lines = [line for line in said if "not made" in line]
    assert copies.refused == pushes                     # every refusal counted: the view shows them
    assert 1 <= len(lines) <= MAX_KINDS + 1, lines       # before: one line for each
    assert len(copies._said) <= MAX_KINDS + 1
