"""A request the server got to late: its wait counts (rdzv_server/delivery/long_poll.py, looplag.py).

An agent expects a held poll's answer within the hold it was told, counted from its sending
(node_agent/client/path_check.py `answer_due`). A poll that waited in a busy server before it was
handled is held only for what is left of its hold, so the agent does not give it up, send it again
and close the held connection (which the server would take for a dead node).
"""
from __future__ import annotations

import asyncio
import time

import pytest

from rdzv_server.delivery import long_poll
from rdzv_server.delivery.hub import Hub
from rdzv_server.web.app import COORDINATOR
from tests.integration.support import wait_until
from tests.integration.test_direct_reply import join, poll, read_reply, request

HOLD_S = 1.5          # a poll handled at once is held: this is the loaded machine's margin for "at once"


@pytest.fixture
def holds(monkeypatch):
    """Every poll held HOLD_S (no jitter), and each wait on the held polls' timer counted."""
    monkeypatch.setattr(long_poll, "hold_for", lambda node_count, status, wait_s: HOLD_S)
    added: list[object] = []
    real_wait = Hub.wait

    def wait(self, sub):  # type: ignore[no-untyped-def]
        added.append(sub)
        real_wait(self, sub)
    monkeypatch.setattr(Hub, "wait", wait)
    return added


@pytest.mark.parametrize("busy_s", [0.0, HOLD_S + 1.0])
async def test_a_poll_the_server_got_to_late_is_held_only_for_what_is_left_of_its_hold(server, holds, busy_s):
    a = await join(server, "a")
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        # written at once (loopback: in the server's kernel as the call returns), then the server
        # (this loop) is busy for a while before it gets to it
        writer.write(request("poll", poll("a", a["credential"], -1, 10.0)))
        if busy_s:
            time.sleep(busy_s)  # noqa: ASYNC251 - the stall under test, not a wait for an event
        else:
            await wait_until(lambda: server.app[COORDINATOR].hub.open == 1)
        head, body = await read_reply(reader)
        assert head[0] == "HTTP/1.1 200 OK" and body["node_state"] == "waiting"
        if busy_s:
            assert holds == [], "a poll whose hold had passed while it waited was held again"
        else:
            assert len(holds) == 1, "a poll handled at once was not held"
    finally:
        writer.close()



async def test_a_poll_sent_behind_another_on_its_connection_is_held_in_full_and_says_nothing_of_the_server(
        server, holds, monkeypatch):
    # pipelined: the second waited for the first's hold, the client's choice, not the server's
    # backlog; counted, it would make the server look behind to every node's lease
    a = await join(server, "a")
    coord = server.app[COORDINATOR]
    noted: list[float] = []
    monkeypatch.setattr(coord.loop_lag, "note_waited", noted.append)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(request("poll", poll("a", a["credential"], -1, 10.0)) * 2)
        for _ in range(2):
            head, body = await read_reply(reader)
            assert head[0] == "HTTP/1.1 200 OK" and body["node_state"] == "waiting"
        assert len(holds) == 2, "the pipelined poll was taken for one the server got to late"
        assert all(waited < HOLD_S for waited in noted), noted
    finally:
        writer.close()
