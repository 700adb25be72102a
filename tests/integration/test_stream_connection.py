"""The stream once upgraded (web/stream_connection.py): its own protocol on the transport, aiohttp's
objects let go. Spoken by a second independent client, the `websockets` library's, which sends
fragments and pings as any WebSocket client may."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest
from aiohttp.test_utils import TestServer
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from rdzv_server.coordinator import Coordinator
from rdzv_server.web.app import create_app
from rdzv_server.web.connections import GUARD, ConnectionGuard
from rdzv_server.web.stream import HUB
from tests.integration.support import start_app, wait_until
from tests.integration.test_stream import LIMIT, config, join_body


@pytest.fixture
async def server() -> AsyncIterator[TestServer]:
    app = create_app(Coordinator())
    app[GUARD] = ConnectionGuard(1000)
    srv = await start_app(app)
    try:
        yield srv
    finally:
        await srv.close()


def ws_url(srv: TestServer, job: str = "j") -> str:
    return f"ws://127.0.0.1:{srv.port}/v1/jobs/{job}/stream"


async def recv(ws: ClientConnection) -> dict[str, Any]:
    data = await asyncio.wait_for(ws.recv(), LIMIT)
    assert isinstance(data, bytes), data
    frame: dict[str, Any] = msgpack.unpackb(data)
    return frame


async def test_a_message_sent_in_fragments_is_one_message(server) -> None:
    async with connect(ws_url(server)) as ws:
        hello = msgpack.packb({"t": "hello", "v": 1, "node_id": "a"})
        await ws.send([hello[:3], hello[3:9], hello[9:]])            # three frames, one message
        join = msgpack.packb({"t": "request", "id": 1, "action": "join", "body": join_body("a", config(1))})
        await ws.send([join[:10], join[10:]])
        reply = await recv(ws)
        assert reply["t"] == "reply" and reply["id"] == 1 and reply["status"]["node_state"] == "member", reply


async def test_frames_after_a_request_wait_for_its_reply(server) -> None:
    """Requests are answered in the order sent: what follows a request is read once it is answered
    (here a frame that breaks the protocol: its error comes after the join's reply, not before)."""
    async with connect(ws_url(server)) as ws:
        await ws.send(msgpack.packb({"t": "hello", "v": 1, "node_id": "a"}))
        join = msgpack.packb({"t": "request", "id": 1, "action": "join", "body": join_body("a", config(2))})
        await ws.send(join)
        await ws.send(msgpack.packb({"t": "launch"}))
        first, second = await recv(ws), await recv(ws)
        assert first["t"] == "reply" and first["id"] == 1, first
        assert second["t"] == "error" and second["code"] == "bad_request", second
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), LIMIT)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008


async def test_pings_are_answered_and_a_close_is_a_dropped_connection(server) -> None:
    hub = server.app[HUB]
    async with connect(ws_url(server)) as ws:
        await ws.send(msgpack.packb({"t": "hello", "v": 1, "node_id": "a"}))
        pong = await ws.ping(b"are you there")
        await asyncio.wait_for(pong, LIMIT)
        assert len(hub.open) == 1
    await wait_until(lambda: len(hub.open) == 0)        # the client's close: the stream is gone


async def test_aiohttp_lets_go_of_an_upgraded_connection_and_the_guard_counts_it(server) -> None:
    """An open stream holds no aiohttp handler, request or task (the memory a stream costs); the
    connection guard still counts it, and forgets it when it closes."""
    guard: ConnectionGuard = server.app[GUARD]
    streams = [await connect(ws_url(server)) for _ in range(20)]
    try:
        for i, ws in enumerate(streams):
            await ws.send(msgpack.packb({"t": "hello", "v": 1, "node_id": f"n{i}"}))
            await ws.send(msgpack.packb({"t": "request", "id": 1, "action": "join",
                                         "body": join_body(f"n{i}", config(20))}))
            assert (await recv(ws))["t"] == "reply"
        assert server.runner is not None and server.runner.server is not None
        await wait_until(lambda: not server.runner.server.connections)      # aiohttp has none of them
        assert len(guard._streams) == 20
        serving = [t for t in asyncio.all_tasks() if "web_protocol" in str(t.get_coro())]
        assert serving == []                   # no aiohttp request or connection task left for them
    finally:
        for ws in streams:
            await ws.close()
    await wait_until(lambda: not guard._streams)
