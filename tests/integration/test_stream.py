"""The stream (`GET /v1/jobs/{job_id}/stream`), spoken by an independent client: plain `msgpack` over
aiohttp's WebSocket client, as docs/protocol.md specifies it. The real app on loopback."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgpack
import pytest
from aiohttp.test_utils import TestServer

from rdzv_server.coordinator import Coordinator
from rdzv_server.web.access import Access
from rdzv_server.web.app import create_app
from rdzv_server.web.routing import COORDINATOR
from rdzv_server.web.stream import HUB
from tests.integration.support import start_app, url, wait_until

LIMIT = 10.0


def config(nodes: int, lease: float = 30.0) -> dict[str, Any]:
    return {"min_nodes": nodes, "max_nodes": nodes, "max_restarts": 5, "last_call_s": 0.0, "lease_timeout_s": lease}


def join_body(node: str, cfg: dict[str, Any]) -> dict[str, Any]:
    return {"v": 1, "node_id": node, "addr": "127.0.0.1", "local_world_size": 1, "master_port": 1,
            "config": cfg, "instance": node}


@pytest.fixture
async def server() -> AsyncIterator[TestServer]:
    srv = await start_app(create_app(Coordinator()))
    try:
        yield srv
    finally:
        await srv.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


class Node:
    """One node's stream, frame by frame."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, node_id: str) -> None:
        self.ws, self.node_id, self.ids, self.credential = ws, node_id, 0, ""

    async def send(self, **frame: Any) -> None:
        await self.ws.send_bytes(msgpack.packb(frame))

    async def recv(self) -> dict[str, Any]:
        msg = await asyncio.wait_for(self.ws.receive(), LIMIT)
        assert msg.type is aiohttp.WSMsgType.BINARY, msg
        frame: dict[str, Any] = msgpack.unpackb(msg.data)
        return frame

    async def request(self, action: str, body: dict[str, Any]) -> dict[str, Any]:
        self.ids += 1
        await self.send(t="request", id=self.ids, action=action, body=body)
        reply = await self.recv()
        assert reply["t"] == "reply" and reply["id"] == self.ids, reply
        return reply

    async def join(self, cfg: dict[str, Any]) -> dict[str, Any]:
        reply = await self.request("join", join_body(self.node_id, cfg))
        self.credential = reply["status"]["credential"]
        return reply["status"]

    async def subscribe(self) -> dict[str, Any]:
        await self.send(t="subscribe", credential=self.credential, known_round=-1)
        frame = await self.recv()
        assert frame["t"] == "status", frame
        return frame["status"]

    async def closed_with(self) -> dict[str, Any]:
        """The error frame the server closes with, then the close itself."""
        frame = await self.recv()
        assert frame["t"] == "error", frame
        msg = await asyncio.wait_for(self.ws.receive(), LIMIT)
        assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING), msg
        return frame


async def open_node(http: aiohttp.ClientSession, server: TestServer, job: str, node: str,
                    hello: bool = True, **kw: Any) -> Node:
    ws = await http.ws_connect(url(server, f"/v1/jobs/{job}/stream"), **kw)
    n = Node(ws, node)
    if hello:
        await n.send(t="hello", v=1, node_id=node)
    return n


async def test_a_round_is_pushed_to_every_node_and_a_failure_report_is_answered_first(server, http) -> None:
    a, b = await open_node(http, server, "j", "a"), await open_node(http, server, "j", "b")
    assert (await a.join(config(2)))["node_state"] == "waiting"
    assert (await a.subscribe())["round_id"] == -1
    await b.join(config(2))
    pushed = await a.recv()
    assert pushed["t"] == "status" and pushed["status"]["assignment"]["round_id"] == 1
    assert (await b.subscribe())["assignment"]["round_id"] == 1
    failure = {"local_rank": 0, "rank": 0, "exitcode": 1}
    reply = await a.request("failure", {"v": 1, "node_id": "a", "credential": a.credential, "round_id": 1,
                                        "failures": [failure]})
    assert reply["status"]["round_id"] == 2          # the report's own reply, before any push to it
    assert (await b.recv())["status"]["assignment"]["round_id"] == 2
    stale = await b.request("failure", {"v": 1, "node_id": "b", "credential": "not-b's", "round_id": 1,
                                        "failures": [failure]})
    assert stale["error"]["code"] == "forbidden" and stale["status"] is None    # refused; the stream stays
    assert (await a.recv())["status"]["assignment"]["round_id"] == 2
    async with http.get(url(server, "/metrics")) as resp:
        text = await resp.text()
    assert 'rdzv_stream_requests_total{action="join",outcome="ok"} 2.0' in text
    assert 'rdzv_stream_requests_total{action="failure",outcome="forbidden"} 1.0' in text
    fan_outs = float(text.split("\nrdzv_stream_flush_seconds_count ")[1].split()[0])
    assert fan_outs >= 2 and "\nrdzv_stream_last_flush_seconds " in text   # round 1 formed, round 2
    await a.ws.close()
    await b.ws.close()


async def test_healthz_advertises_the_stream_and_poll_is_not_a_stream_action(server, http) -> None:
    async with http.get(url(server, "/healthz")) as resp:
        assert (await resp.json())["stream"] == 1
    a = await open_node(http, server, "j", "a")
    await a.send(t="request", id=1, action="poll", body={"v": 1, "node_id": "a"})
    frame = await a.closed_with()
    assert frame["code"] == "bad_request" and "subscribe" in frame["message"]


@pytest.mark.parametrize("payload, code, words", [
    (b"\xc1garbage", "bad_request", "bad frame"),
    (msgpack.packb([1, 2, 3]), "bad_request", "bad frame"),
    (msgpack.packb({"t": "launch"}), "bad_request", "bad frame"),
    (msgpack.packb({"t": "hello", "v": 2, "node_id": "a"}), "unsupported_version", "version 2"),
    (msgpack.packb({"t": "hello", "v": 1, "node_id": "bad id\n"}), "bad_request", "node_id"),
    (msgpack.packb({"t": "subscribe", "credential": "x"}), "bad_request", "first frame must be `hello`"),
])
async def test_garbage_frames_close_the_stream_with_an_error_frame(server, http, payload, code, words) -> None:
    a = await open_node(http, server, "j", "a", hello=False)
    await a.ws.send_bytes(payload)
    frame = await a.closed_with()
    assert frame["code"] == code and words in frame["message"], frame
    async with http.get(url(server, "/metrics")) as resp:
        assert 'rdzv_streams_closed_total{reason="bad frame: ' in await resp.text()


async def test_a_text_frame_and_an_oversize_frame_are_refused_without_a_5xx(server, http) -> None:
    a = await open_node(http, server, "j", "a")
    await a.ws.send_str("hello")
    assert "binary" in (await a.closed_with())["message"]
    b = await open_node(http, server, "j", "b")
    await b.ws.send_bytes(b"\x00" * (2 << 20))
    refused = await b.closed_with()          # an error frame naming it, then the close (1009: too big)
    assert refused["code"] == "too_large" and "1052672" in refused["message"], refused     # the limit named
    assert b.ws.close_code == 1009
    async with http.get(url(server, "/metrics")) as resp:
        text = await resp.text()
    assert 'reason="bad frame: too_large"' in text and 'status="5' not in text


async def test_frames_for_another_node_change_nothing_and_close_the_stream(server, http) -> None:
    a, b = await open_node(http, server, "j", "a"), await open_node(http, server, "j", "b")
    await a.join(config(3))
    await b.join(config(3))
    # b's stream asks to leave as a, with a's credential: refused, and a stays.
    await b.send(t="request", id=7, action="leave", body={"v": 1, "node_id": "a", "credential": a.credential})
    frame = await b.closed_with()
    assert frame["code"] == "forbidden" and "stream of node 'b'" in frame["message"]
    # a subscription with another node's credential is forbidden as well.
    c = await open_node(http, server, "j", "b")
    await c.send(t="subscribe", credential=a.credential, known_round=-1)
    assert (await c.closed_with())["code"] == "forbidden"
    coord = server.app[COORDINATOR]
    assert set(coord.core.jobs["j"].nodes) == {"a", "b"} and coord.core.jobs["j"].nodes["a"].holding == 0


async def test_a_silent_stream_is_closed_and_its_node_lost_within_the_lease(server, http) -> None:
    a, b = await open_node(http, server, "j", "a"), await open_node(http, server, "j", "b")
    await a.join(config(3, lease=0.5))
    await b.join(config(3, lease=0.5))
    await a.subscribe()
    await b.subscribe()

    async def beat() -> None:
        while True:
            await b.send(t="heartbeat")
            await asyncio.sleep(0.15)              # the client's period (lease / 3), not a wait for an event

    beating = asyncio.create_task(beat())
    try:
        frame = await a.closed_with()              # a sends nothing
        assert frame["code"] == "limit_reached" and "heartbeat" in frame["message"]   # retryable: it may come back
        job = server.app[COORDINATOR].core.jobs["j"]
        await wait_until(lambda: "a" not in job.nodes)   # lost: its lease ran from its last frame
        assert "b" in job.nodes and job.nodes["b"].holding == 1 and not b.ws.closed
    finally:
        beating.cancel()
        await asyncio.gather(beating, return_exceptions=True)


async def test_a_closed_stream_is_a_dropped_connection(server, http) -> None:
    a, b = await open_node(http, server, "j", "a"), await open_node(http, server, "j", "b")
    await a.join(config(2))
    await a.subscribe()
    await b.join(config(2))
    await a.recv()
    await b.subscribe()
    await a.ws.close()
    pushed = await b.recv()                        # within the drop grace (1 s), not the 30 s lease
    assert pushed["status"]["node_state"] == "waiting" and "a" in pushed["status"]["reason"]


async def test_the_stream_takes_the_agent_token_and_refuses_a_foreign_origin() -> None:
    srv = await start_app(create_app(Coordinator(), access=Access(agent_token=b"s3cret")))
    try:
        async with aiohttp.ClientSession() as http:
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await http.ws_connect(url(srv, "/v1/jobs/j/stream"))
            assert refused.value.status == 401
            with pytest.raises(aiohttp.WSServerHandshakeError) as foreign:
                await http.ws_connect(url(srv, "/v1/jobs/j/stream"), origin="http://evil.example",
                                      headers={"Authorization": "Bearer s3cret"})
            assert foreign.value.status == 403
            ws = await http.ws_connect(url(srv, "/v1/jobs/j/stream"), headers={"Authorization": "Bearer s3cret"})
            a = Node(ws, "a")
            await a.send(t="hello", v=1, node_id="a")
            assert (await a.join(config(1)))["node_state"] == "member"
            await ws.close()
    finally:
        await srv.close()


async def test_a_plain_get_is_refused_with_a_4xx(server, http) -> None:
    async with http.get(url(server, "/v1/jobs/j/stream")) as resp:
        assert resp.status == 400 and "WebSocket" in (await resp.json())["message"]
    assert len(server.app[HUB].open) == 0
