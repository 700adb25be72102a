"""Agents vouch for each other on real loopback sockets: in contact, alone, or not there at all."""
from __future__ import annotations

import asyncio
import socket

import pytest

from node_agent.client.replies import Path
from node_agent.client.witness import WitnessServer
from node_agent.core.facts import Verdict, WitnessesAnswered
from node_agent.witness import ask_witnesses, verdict, witnesses_and_server
from protocol.messages import Witness


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]                 # nothing listens there once it is closed


async def test_the_verdict_follows_what_the_witnesses_say_about_the_server_and_their_round():
    hears, alone, held = [True], [False], [3]
    a = WitnessServer("127.0.0.1", lambda: hears[0], lambda: held[0])
    b = WitnessServer("127.0.0.1", lambda: alone[0], lambda: 3)
    try:
        wa, wb = Witness(addr="127.0.0.1", port=await a.start()), Witness(addr="127.0.0.1", port=await b.start())
        nobody = Witness(addr="127.0.0.1", port=closed_port())
        assert await ask_witnesses((wa, wb), 3) == Verdict.STILL_MEMBER   # it hears the server, in this node's round
        held[0] = 4
        assert await ask_witnesses((wa, wb), 3) == Verdict.ROUND_REPLACED     # a newer round: this node's is over
        assert await ask_witnesses((wa, wb), 4) == Verdict.STILL_MEMBER
        held[0] = -1       # told its round is over (this node's loss left the job below its minimum): no newer one
        assert await ask_witnesses((wa, wb), 3) == Verdict.ROUND_REPLACED
        assert await ask_witnesses((wa, wb), -1) == Verdict.STILL_MEMBER      # an asker running nothing: no evidence
        hears[0] = False
        assert await ask_witnesses((wa, wb)) == Verdict.SERVER_AWAY           # none hears it: the server is away
        assert await ask_witnesses((nobody, wb)) == Verdict.SERVER_AWAY
        assert await ask_witnesses((nobody,), timeout=0.5) == Verdict.SILENT   # nobody answers
        assert await ask_witnesses(()) == Verdict.SILENT
    finally:
        await a.close()
        await b.close()


async def test_a_connection_that_asks_nothing_gets_nothing_and_older_answers_are_still_understood():
    """What a connection is for is told by its first line, never by how soon it comes (a peer copy's request under
    load came late and was answered as a witness probe)."""
    w = WitnessServer("127.0.0.1", lambda: True, lambda: 7)
    try:
        port = await w.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)   # asks nothing
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(reader.readline(), 1.0)
        writer.write(b"rdzv-agent ask round=3\n")                           # late, but a question: answered
        assert await asyncio.wait_for(reader.readline(), 5) == b"rdzv-agent in-contact round=7\n"
        writer.close()
    finally:
        await w.close()
    assert verdict([b"rdzv-agent in-contact\n", b""], 3) == Verdict.SERVER_HEARD   # an older witness: no round said
    assert verdict([b"rdzv-agent alone\n"], 3) == Verdict.SERVER_AWAY
    assert verdict([b"rdzv-agent in-contact round=2\n"], 3) == Verdict.STILL_MEMBER   # older news: no evidence
    assert verdict([b"garbage\n", None], 3) == Verdict.UNANSWERED    # reached: this node is not cut off
    assert verdict([b"", None], 3) == Verdict.UNANSWERED
    assert verdict([None, None], 3) == Verdict.SILENT


async def test_a_probe_waits_for_the_server_check_only_where_the_witnesses_leave_it_open():
    held, checks_ended = [4], []

    async def silent_server() -> str:       # a cut path: the check would run to its own timeout
        try:
            await asyncio.Event().wait()
        finally:
            checks_ended.append(True)
        return Path.NO_SERVER

    async def no_server() -> str:
        return Path.NO_SERVER

    w = WitnessServer("127.0.0.1", lambda: True, lambda: held[0])
    try:
        witness = Witness(addr="127.0.0.1", port=await w.start())
        # a witness holds a newer round: evidence at once, however long the server check would take
        said = await asyncio.wait_for(witnesses_and_server((witness,), 3, silent_server), 5)
        assert said == WitnessesAnswered(Verdict.ROUND_REPLACED, None) and checks_ended == [True]
        held[0] = 3
        said = await asyncio.wait_for(witnesses_and_server((witness,), 3, silent_server), 5)
        assert said == WitnessesAnswered(Verdict.STILL_MEMBER, None)
    finally:
        await w.close()
    nobody = Witness(addr="127.0.0.1", port=closed_port())
    said = await witnesses_and_server((nobody,), 3, no_server)
    assert said == WitnessesAnswered(Verdict.SILENT, Path.NO_SERVER)   # the check decides


async def test_a_witness_whose_port_is_flooded_is_no_evidence_that_this_node_is_cut_off():
    """A stranger holding every connection a witness's agent may have open makes it close the next ones unanswered:
    the asker reached it, so it is not cut off, whatever the server check says (the server away meanwhile)."""
    from node_agent.client.listener import Caps

    async def no_server() -> str:
        return Path.NO_SERVER

    w = WitnessServer("127.0.0.1", lambda: False, lambda: 3, caps=Caps(total=16, per_source=64))
    held: list[asyncio.StreamWriter] = []
    try:
        witness = Witness(addr="127.0.0.1", port=await w.start())
        for _ in range(40):                     # idle, asking nothing: the cap and more
            held.append((await asyncio.open_connection("127.0.0.1", witness.port))[1])
        said = await witnesses_and_server((witness,), 3, no_server)
        assert said.verdict in (Verdict.UNANSWERED, Verdict.SERVER_AWAY), said   # answered, or not: never SILENT
    finally:
        for writer in held:
            writer.close()
        await w.close()
