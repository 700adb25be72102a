"""Agents vouch for each other while the server is silent: "are you there, and do you hear it?"

Each agent listens on a free port of its own address and answers every connection with one line
before closing it: whether it is in contact with the server itself (IN_CONTACT) or not (ALONE). It
tells the server the port at join, and the server hands each member up to two other members to ask
(Assignment.witnesses). An agent that lost the server asks them (fencing, policy.py):
- a witness that hears the server: the server is up and only this node is cut off from it, so the
  server has replaced this node's round: its workers must stop;
- witnesses that answer but do not hear the server either: the server itself is away (its link, its
  process): the round goes on and the workers stay;
- no answer at all, twice: this node is cut off from everyone: its workers must stop.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from node_agent.core.facts import SERVER_AWAY, SERVER_HEARD, SILENT
from protocol.messages import Witness

IN_CONTACT = b"rdzv-agent in-contact\n"
ALONE = b"rdzv-agent alone\n"
PROBE_TIMEOUT_S = 1.0


class WitnessServer:
    def __init__(self, addr: str, in_contact: Callable[[], bool]) -> None:
        self.addr = addr
        self.in_contact = in_contact
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        """Listen on a free port of `addr`; 0 when that is not possible (then nobody asks this node)."""
        try:
            self._server = await asyncio.start_server(self._answer, self.addr, 0)
        except OSError:
            return 0
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            writer.write(IN_CONTACT if self.in_contact() else ALONE)
            await writer.drain()
        writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()




async def ask_witnesses(witnesses: tuple[Witness, ...], timeout: float = PROBE_TIMEOUT_S) -> str:
    """The witnesses' verdict (SERVER_AWAY, SERVER_HEARD or SILENT)."""
    async def ask(w: Witness) -> bytes:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(w.addr, w.port), timeout)
        except (OSError, asyncio.TimeoutError):
            return b""
        try:
            return await asyncio.wait_for(reader.readline(), timeout)
        except (OSError, asyncio.TimeoutError, ValueError):
            return b""
        finally:
            writer.close()

    answers = await asyncio.gather(*(ask(w) for w in witnesses))
    if IN_CONTACT in answers:
        return SERVER_HEARD
    return SERVER_AWAY if ALONE in answers else SILENT
