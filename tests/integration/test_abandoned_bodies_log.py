"""Clients that close their connections in the middle of their bodies, over and over, write a bounded number of
lines to the server's log (rdzv_server/logs.py ClientFaultLines): before, one line each (8 MB in 45 s from one
flooding client, no token needed); the rest is counted."""
from __future__ import annotations

import asyncio
import logging

import pytest

from rdzv_server import logs
from rdzv_server.logs import CLIENT_FAULT_LINES, ClientFaultLines
from tests.integration.support import wait_until

SAID = "closed the connection before its request body arrived"


@pytest.fixture
def budget(monkeypatch):
    lines = ClientFaultLines()
    monkeypatch.setattr(logs, "CLIENT_FAULTS", lines)
    return lines


async def test_bodies_abandoned_in_a_flood_are_logged_a_bounded_number_of_times(server, budget, caplog):
    caplog.set_level(logging.INFO, logger="rdzv_server")
    flood = 3 * CLIENT_FAULT_LINES
    for _ in range(flood):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /v1/jobs/j/poll HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/msgpack\r\n"
                     b"Content-Length: 100\r\n\r\nab")
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    def said() -> int:
        return sum(SAID in r.getMessage() for r in caplog.records)
    await wait_until(lambda: said() + budget._unsaid == flood)
    assert said() == CLIENT_FAULT_LINES
