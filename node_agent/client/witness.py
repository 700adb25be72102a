"""The witness wire: agents vouch for each other while the server is silent ("do you hear it, which round
do you hold?"); shared with the torchrun plugin, the answers read together in node_agent/witness.py.

Each agent listens on a free port, named at join; the server hands each member up to two others to ask
(Assignment.witnesses). The asker sends `rdzv-agent ask round=R`; the witness answers one line and closes:
`rdzv-agent in-contact round=W` or `rdzv-agent alone round=W` (W: its round, -1: none). An older asker
sends no question: after ASK_WAIT_S it gets `rdzv-agent in-contact` or `rdzv-agent alone`, which all read."""
from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Awaitable, Callable

from protocol.messages import Witness

IN_CONTACT = b"rdzv-agent in-contact\n"     # the older answers, with no round
ALONE = b"rdzv-agent alone\n"
ASK = b"rdzv-agent ask round=%d\n"
ANSWER = b"rdzv-agent %s round=%d\n"
ANSWER_LINE = re.compile(rb"rdzv-agent (in-contact|alone)(?: round=(-?\d{1,12}))?\n")
_ASK = re.compile(rb"rdzv-agent ask round=(-?\d{1,12})\n")
PROBE_TIMEOUT_S = 1.0
READ_BUFFER = 1 << 20
ASK_WAIT_S = 0.3      # an older asker sends no question: answered the older way after this


Serve = Callable[[bytes, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class WitnessServer:
    def __init__(self, addr: str, in_contact: Callable[[], bool], holds: Callable[[], int] = lambda: -1,
                 copies: tuple[Callable[[bytes], bool], Serve] | None = None) -> None:
        """`in_contact()`: whether this agent hears the server; `holds()`: the round it runs (-1: none);
        `copies`: (whether a first line is a peer copy's request, what serves it: node_agent/copies.py)."""
        self.addr = addr
        self.in_contact = in_contact
        self.holds = holds
        self.copies = copies
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        """Listen on a free port of `addr`; 0 when that is not possible (then nobody asks this node)."""
        try:
            # A reader's buffer of a copy's chunk (replicas/stream.py): peer copies come through here too.
            self._server = await asyncio.start_server(self._answer, self.addr, 0, limit=READ_BUFFER)
        except OSError:
            return 0
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.TimeoutError, ValueError):
            try:
                line = await asyncio.wait_for(reader.readline(), ASK_WAIT_S)
            except asyncio.TimeoutError:
                line = b""
            if self.copies is not None and self.copies[0](line):
                await self.copies[1](line, reader, writer)
                writer.close()
                return
            asked = _ASK.fullmatch(line)
            contact = self.in_contact()
            if asked is None:
                writer.write(IN_CONTACT if contact else ALONE)
            else:
                writer.write(ANSWER % (b"in-contact" if contact else b"alone", self.holds()))
            await writer.drain()
        writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


def read_answer(line: bytes) -> tuple[bool, int | None] | None:
    """(hears the server, the round it runs or None when an older witness did not say), or None for no answer."""
    m = ANSWER_LINE.fullmatch(line)
    if m is None:
        return None
    return m.group(1) == b"in-contact", int(m.group(2)) if m.group(2) is not None else None


async def ask_each(witnesses: tuple[Witness, ...], round_id: int = -1, timeout: float = PROBE_TIMEOUT_S) -> list[bytes]:
    """Each witness's answer line, asked at once (b"" where none came within `timeout`)."""
    async def ask(w: Witness) -> bytes:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(w.addr, w.port), timeout)
        except (OSError, asyncio.TimeoutError):
            return b""
        try:
            writer.write(ASK % round_id)
            await writer.drain()
            return await asyncio.wait_for(reader.readline(), timeout)
        except (OSError, asyncio.TimeoutError, ValueError):
            return b""
        finally:
            writer.close()

    return list(await asyncio.gather(*(ask(w) for w in witnesses)))
