"""A held long-poll woken by a change is answered during the wake itself (web/direct_reply.py).

Spoken with raw sockets and the plain `msgpack` package, so the bytes on the wire are what is
checked: the direct reply must be the reply aiohttp would have sent, and the connection must go on
serving the node's next request.
"""
from __future__ import annotations

import asyncio

import msgpack
import pytest

from protocol.messages import JobConfig, JoinRequest, LeaveRequest, NodeStatus, PollRequest
from rdzv_server.coordinator import Coordinator
from rdzv_server.delivery.connection import Connection
from rdzv_server.delivery.long_poll import LongPoll
from rdzv_server.web import app as web_app
from rdzv_server.web.app import COORDINATOR
from rdzv_server.web.direct_reply import DirectReply
from tests.integration.support import wait_until

CONFIG = {"min_nodes": 2, "max_nodes": 2, "last_call_s": 30.0, "lease_timeout_s": 10.0}


class CountingReply(DirectReply):
    """The server's DirectReply, remembering which were used to send."""
    sent_by: list[CountingReply] = []

    def __call__(self, status):  # type: ignore[no-untyped-def]
        done = super().__call__(status)
        if done:
            CountingReply.sent_by.append(self)
        return done


@pytest.fixture
def counting(monkeypatch):
    CountingReply.sent_by = []
    monkeypatch.setattr(web_app, "DirectReply", CountingReply)
    return CountingReply.sent_by


def request(action: str, body: dict, version: str = "1.1", extra: str = "") -> bytes:
    data = msgpack.packb(body)
    return (f"POST /v1/jobs/j/{action} HTTP/{version}\r\nHost: 127.0.0.1\r\nContent-Type: application/msgpack\r\n"
            f"Content-Length: {len(data)}\r\n{extra}\r\n").encode() + data


async def read_reply(reader: asyncio.StreamReader) -> tuple[list[str], dict]:
    """The status line and header lines of one reply, and its decoded body."""
    head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)).decode("latin-1").split("\r\n")[:-2]
    length = next(int(line.split(":")[1]) for line in head if line.lower().startswith("content-length:"))
    return head, msgpack.unpackb(await reader.readexactly(length))


async def join(server, node: str) -> dict:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(request("join", {"v": 1, "node_id": node, "addr": "10.0.0.1", "local_world_size": 1,
                                      "master_port": 29500, "config": CONFIG}))
        return (await read_reply(reader))[1]
    finally:
        writer.close()


def poll(node: str, credential: str, known_round: int, wait_s: float) -> dict:
    return {"v": 1, "node_id": node, "credential": credential, "known_round": known_round, "wait_s": wait_s}


def holding(server, node: str) -> int:
    return server.app[COORDINATOR].core.jobs["j"].nodes[node].holding


async def test_a_woken_poll_is_answered_from_the_wake_as_aiohttp_would_and_its_connection_goes_on(server, counting):
    a = await join(server, "a")
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(request("poll", poll("a", a["credential"], -1, 10.0)))
        await wait_until(lambda: server.app[COORDINATOR].hub.open == 1)      # held
        b = await join(server, "b")                   # the round forms: a's poll is woken
        head, body = await read_reply(reader)
        assert len(counting) == 1, "the woken poll was answered by its task, not from the wake"
        assert body["node_state"] == "member" and body["assignment"]["group_rank"] == 0
        assert body["round_id"] == b["round_id"] == 1
        assert body["poll_hold_s"] > 0                # the same hold advice the task would add
        assert head[0] == "HTTP/1.1 200 OK"
        assert holding(server, "a") == 0              # the task caught up: the poll has ended
        # the same connection serves the next poll; its hold ends, so aiohttp itself answers it
        writer.write(request("poll", poll("a", a["credential"], 1, 0.1)))
        head2, body2 = await read_reply(reader)
        assert len(counting) == 1
        assert body2["round_id"] == 1
        assert head2[0] == head[0]
        assert [line.split(":")[0] for line in head] == [line.split(":")[0] for line in head2]   # same headers
        assert [line for line in head if not line.startswith(("Date:", "Content-Length:"))] == \
            [line for line in head2 if not line.startswith(("Date:", "Content-Length:"))]
    finally:
        writer.close()
    metrics = server.app[web_app.METRICS].exposition().decode()
    assert 'rdzv_http_requests_total{method="POST",route="/v1/jobs/{job_id}/poll",status="200"} 2.0' in metrics


async def test_a_bug_after_the_reply_went_out_closes_the_connection_instead_of_a_second_reply(server, counting,
                                                                                              monkeypatch, caplog):
    a = await join(server, "a")
    core = server.app[COORDINATOR].core

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("a bug in the poll's end")
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(request("poll", poll("a", a["credential"], -1, 10.0)))
        await wait_until(lambda: server.app[COORDINATOR].hub.open == 1)
        monkeypatch.setattr(core, "poll_ended", broken)
        await join(server, "b")
        head, body = await read_reply(reader)
        assert head[0] == "HTTP/1.1 200 OK" and body["node_state"] == "member" and len(counting) == 1
        assert await asyncio.wait_for(reader.read(), 10) == b""     # nothing more: the connection closed
    finally:
        writer.close()
    assert "after its reply was sent" in caplog.text and "a bug in the poll's end" in caplog.text


@pytest.mark.parametrize("version, extra", [("1.0", ""), ("1.1", "Connection: close\r\n")])
async def test_a_poll_that_closes_its_connection_is_answered_by_aiohttp(server, counting, version, extra):
    a = await join(server, "a")
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(request("poll", poll("a", a["credential"], -1, 10.0), version, extra))
        await wait_until(lambda: server.app[COORDINATOR].hub.open == 1)
        await join(server, "b")
        head, body = await read_reply(reader)
        assert head[0] == f"HTTP/{version} 200 OK" and body["node_state"] == "member"
        assert counting == []
        assert await asyncio.wait_for(reader.read(), 10) == b""     # and the connection is closed
    finally:
        writer.close()


# -- the coordinator's side, with a stand-in for the connection --

def _join(node: str) -> JoinRequest:
    return JoinRequest(v=1, node_id=node, addr="10.0.0.1", local_world_size=1, master_port=29500,
                       config=JobConfig(min_nodes=2, max_nodes=2, last_call_s=30.0, lease_timeout_s=10.0))


async def _held_poll(coord: Coordinator, reply) -> tuple[asyncio.Task, str]:  # type: ignore[no-untyped-def]
    a = await coord.handle("j", _join("a"))
    task = asyncio.ensure_future(coord.handle("j", PollRequest(v=1, node_id="a", credential=a.credential,
                                                               known_round=-1, wait_s=10.0), Connection(reply=reply)))
    await wait_until(lambda: coord.hub.open == 1)
    return task, a.credential


async def test_a_reply_that_fails_leaves_the_answer_to_the_task():
    coord = Coordinator()
    await coord.start()
    try:
        def broken(status):  # type: ignore[no-untyped-def]
            raise RuntimeError("a bug in the writer")
        task, _ = await _held_poll(coord, broken)
        await coord.handle("j", _join("b"))
        status = await asyncio.wait_for(task, 10)
        assert status.round_id == 1 and status.assignment is not None
        assert coord.core.jobs["j"].nodes["a"].holding == 0
    finally:
        await coord.stop()


async def test_a_change_not_yet_saved_is_not_sent_from_the_wake(monkeypatch):
    coord = Coordinator()
    await coord.start()
    try:
        sent = []
        task, _ = await _held_poll(coord, lambda status: sent.append(status) or True)
        monkeypatch.setattr(coord.persister, "pending", lambda job_id: True)
        await coord.handle("j", _join("b"))
        status = await asyncio.wait_for(task, 10)
        assert sent == [] and status.round_id == 1
    finally:
        await coord.stop()


async def test_a_change_that_leaves_a_polls_view_as_it_was_does_not_wake_its_task(monkeypatch):
    created: list[asyncio.Future[None]] = []        # every wait of a held poll's task for the hub
    real_woken = LongPoll.woken

    def woken(self: LongPoll) -> asyncio.Future[None]:
        created.append(real_woken(self))
        return created[-1]

    monkeypatch.setattr(LongPoll, "woken", woken)
    coord = Coordinator()
    await coord.start()
    try:
        sent = []
        config = JobConfig(min_nodes=3, max_nodes=3, last_call_s=30.0, lease_timeout_s=10.0)

        async def join(node: str) -> NodeStatus:
            return await coord.handle("j", JoinRequest(v=1, node_id=node, addr="10.0.0.1", local_world_size=1,
                                                       master_port=29500, config=config))
        a, b = await join("a"), await join("b")
        task = asyncio.ensure_future(coord.handle("j", PollRequest(v=1, node_id="a", credential=a.credential,
                                                                   known_round=-1, wait_s=10.0),
                                                  Connection(reply=lambda status: sent.append(status) or True)))
        await wait_until(lambda: coord.hub.open == 1)
        epoch = coord.core.jobs["j"].epoch
        await coord.handle("j", LeaveRequest(v=1, node_id="b", credential=b.credential))
        assert coord.core.jobs["j"].epoch > epoch, "the leave should wake the job's polls"
        # a is still waiting: its task was not woken (its future unset, no new wait), nothing sent
        assert len(created) == 1 and not created[0].done() and sent == []
        await join("c")
        await join("d")                   # the round forms: a's reply goes out from the wake
        status = await asyncio.wait_for(task, 10)
        assert len(created) == 1 and len(sent) == 1 and sent[0].round_id == 1 and status is not None
    finally:
        await coord.stop()


async def test_a_poll_cancelled_after_its_answer_went_out_ends_as_answered_not_dropped():
    coord = Coordinator()
    await coord.start()
    try:
        sent = []
        task, _ = await _held_poll(coord, lambda status: sent.append(status) or True)
        await coord.handle("j", _join("b"))       # the wake sends the answer; the task has not run yet
        assert len(sent) == 1 and not task.done()
        task.cancel()                              # its connection closes before the task catches up
        with pytest.raises(asyncio.CancelledError):
            await task
        node = coord.core.jobs["j"].nodes["a"]
        assert node.holding == 0 and not node.dropped
        assert coord.core.jobs["j"].nodes.keys() == {"a", "b"}
    finally:
        await coord.stop()
