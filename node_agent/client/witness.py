"""The witness wire: agents vouch for each other while the server is silent ("do you hear it, which round
do you hold?"); shared with the torchrun plugin, the answers read together in node_agent/witness.py.

Each agent listens on a free port, named at join; the server hands each member up to two others to ask
(Assignment.witnesses). The asker sends `rdzv-agent ask round=R`; the witness answers one line and closes:
`rdzv-agent in-contact round=W` or `rdzv-agent alone round=W` (W: its round, -1: none). What a connection is for
is told by its first line alone, never by timing: a peer copy's request comes to this port too. A connection
that asks nothing gets nothing (agents before the question read `rdzv-agent in-contact` or `rdzv-agent alone`
still, from older witnesses). The port is a listener that faces strangers (listener.py)."""
from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable

from node_agent.client.listener import Listener, agent_caps
from protocol.accepting import Caps
from protocol.messages import Witness

ANSWER = b"rdzv-agent %s round=%d\n"
ANSWER_LINE = re.compile(rb"rdzv-agent (in-contact|alone)(?: round=(-?\d{1,12}))?\n")
_ASK = re.compile(rb"rdzv-agent ask round=(-?\d{1,12})\n")
ASK = b"rdzv-agent ask round=%d\n"
ASK_TIMEOUT_S = 1.0


Serve = Callable[[bytes, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class WitnessServer:
    def __init__(self, addr: str, in_contact: Callable[[], bool], holds: Callable[[], int] = lambda: -1,
                 copies: tuple[Callable[[bytes], bool], Serve] | None = None, *, caps: Caps | None = None,
                 say: Callable[[str], None] = lambda line: None) -> None:
        """`in_contact()`: whether this agent hears the server; `holds()`: the round it runs (-1: none);
        `copies`: (whether a first line is a peer copy's request, what serves it: node_agent/copies/peers.py);
        `caps`: the connections the agent's listeners may hold together."""
        self.addr = addr
        self.in_contact = in_contact
        self.holds = holds
        self.copies = copies
        self.port = 0
        self._listener = Listener(self._answer, caps if caps is not None else agent_caps(), say, name="witness port")

    async def start(self) -> int:
        """Listen on a free port of `addr`; 0 when that is not possible (then nobody asks this node)."""
        self.port = await self._listener.start(self.addr)
        return self.port

    async def _answer(self, line: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.copies is not None and self.copies[0](line):
            await self.copies[1](line, reader, writer)
        elif _ASK.fullmatch(line) is not None:
            writer.write(ANSWER % (b"in-contact" if self.in_contact() else b"alone", self.holds()))
            await asyncio.wait_for(writer.drain(), ASK_TIMEOUT_S)

    async def close(self) -> None:
        await self._listener.close()


def read_answer(line: bytes | None) -> tuple[bool, int | None] | None:
    """(hears the server, the round it runs or None when an older witness did not say), or None for no answer."""
    m = ANSWER_LINE.fullmatch(line) if line else None
    if m is None:
        return None
    return m.group(1) == b"in-contact", int(m.group(2)) if m.group(2) is not None else None


async def ask_each(witnesses: tuple[Witness, ...], round_id: int = -1,
                   timeout: float = ASK_TIMEOUT_S) -> list[bytes | None]:
    """Each witness's answer line, asked at once: b"" where it took the connection but no answer came within
    `timeout` (closed, silent), None where it could not be reached at all (no connection within `timeout`)."""
    async def ask(w: Witness) -> bytes | None:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(w.addr, w.port), timeout)
        except (OSError, asyncio.TimeoutError):
            return None
        try:
            writer.write(ASK % round_id)
            await writer.drain()
            return await asyncio.wait_for(reader.readline(), timeout)
        except (OSError, asyncio.TimeoutError, ValueError):
            return b""
        finally:
            writer.close()

    return list(await asyncio.gather(*(ask(w) for w in witnesses)))
