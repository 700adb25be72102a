"""Agents vouch for each other on real loopback sockets: in contact, alone, or not there at all."""
from __future__ import annotations

import socket

from node_agent.core.facts import SERVER_AWAY, SERVER_HEARD, SILENT
from node_agent.witness import WitnessServer, ask_witnesses
from protocol.messages import Witness


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]                 # nothing listens there once it is closed


async def test_the_verdict_follows_what_the_witnesses_say_about_the_server():
    hears, alone = [True], [False]
    a, b = WitnessServer("127.0.0.1", lambda: hears[0]), WitnessServer("127.0.0.1", lambda: alone[0])
    try:
        wa, wb = Witness(addr="127.0.0.1", port=await a.start()), Witness(addr="127.0.0.1", port=await b.start())
        nobody = Witness(addr="127.0.0.1", port=closed_port())
        assert await ask_witnesses((wa, wb)) == SERVER_HEARD          # one still hears it: this node is cut off
        hears[0] = False
        assert await ask_witnesses((wa, wb)) == SERVER_AWAY           # none hears it: the server is away
        assert await ask_witnesses((nobody, wb)) == SERVER_AWAY
        assert await ask_witnesses((nobody,), timeout=0.5) == SILENT   # nobody answers
        assert await ask_witnesses(()) == SILENT
    finally:
        await a.close()
        await b.close()
