"""The real rendezvous app on loopback, spoken to over HTTP.

`MsgpackNode` uses only the plain `msgpack` package (not our protocol package), so these tests
also pin the wire format for clients written elsewhere.
"""
from __future__ import annotations

import asyncio
import json

import aiohttp
import msgpack
import pytest

from rdzv_server.web import connections
from rdzv_server.web.app import COORDINATOR
from tests.integration.support import remember_credential, url, wait_until, with_credential

MSGPACK = {"Content-Type": "application/msgpack"}


class MsgpackNode:
    """A node written against the wire only: dicts in, dicts out."""

    def __init__(self, http, server, job, node_id, lws=2, port=1000, **config):
        self.http, self.server, self.job, self.node_id = http, server, job, node_id
        self.lws, self.port, self.config = lws, port, config

    async def post(self, action: str, body: dict, expect: int = 200) -> dict:
        body = with_credential(self.server, self.job, body)
        async with self.http.post(url(self.server, f"/v1/jobs/{self.job}/{action}"), data=msgpack.packb(body),
                                  headers=MSGPACK) as resp:
            assert resp.headers["Content-Type"].startswith("application/msgpack")
            reply = msgpack.unpackb(await resp.read())
            assert resp.status == expect, reply
            remember_credential(self.server, self.job, self.node_id, reply)
            return reply

    async def join(self, expect: int = 200) -> dict:
        return await self.post("join", {"v": 1, "node_id": self.node_id, "addr": f"10.0.0.{self.port % 250}",
                                        "local_world_size": self.lws, "master_port": self.port,
                                        "config": self.config}, expect)

    async def poll(self, known_round: int = -1, wait_s: float = 2.0) -> dict:
        return await self.post("poll", {"v": 1, "node_id": self.node_id, "known_round": known_round,
                                        "wait_s": wait_s})


async def test_two_nodes_form_a_round_and_learn_it_through_the_long_poll(server, http):
    a = MsgpackNode(http, server, "job1", "a", lws=2, port=1001, min_nodes=2, max_nodes=2)
    b = MsgpackNode(http, server, "job1", "b", lws=3, port=1002, min_nodes=2, max_nodes=2)
    first = await a.join()
    assert first["node_state"] == "waiting" and first["assignment"] is None
    waiter = asyncio.create_task(a.poll(wait_s=10))
    second = await b.join()
    got = await asyncio.wait_for(waiter, 5)
    assert got["node_state"] == "member" and second["node_state"] == "member"
    ga, gb = got["assignment"], second["assignment"]
    assert (ga["group_rank"], gb["group_rank"]) == (0, 1)
    assert (ga["rank_offset"], gb["rank_offset"]) == (0, 2)
    assert ga["world_size"] == gb["world_size"] == 5
    assert ga["master_addr"] == gb["master_addr"] == "10.0.0.1"
    assert ga["master_port"] == gb["master_port"] == 1001
    assert ga["round_id"] == gb["round_id"] == 1


async def test_failure_report_wakes_the_other_nodes_long_poll_with_the_next_round(server, http):
    a = MsgpackNode(http, server, "job2", "a", min_nodes=2, max_nodes=2, max_restarts=3)
    b = MsgpackNode(http, server, "job2", "b", min_nodes=2, max_nodes=2, max_restarts=3)
    await a.join()
    round1 = (await b.join())["assignment"]["round_id"]
    waiter = asyncio.create_task(a.poll(known_round=round1, wait_s=10))
    reply = await b.post("failure", {"v": 1, "node_id": "b", "round_id": round1,
                                     "failures": [{"local_rank": 0, "rank": 2, "exitcode": 1}]})
    woken = await asyncio.wait_for(waiter, 5)
    assert reply["assignment"]["round_id"] == woken["assignment"]["round_id"] == round1 + 1
    assert reply["restart_count"] == woken["assignment"]["restart_count"] == 1
    stale = await b.post("failure", {"v": 1, "node_id": "b", "round_id": round1,
                                     "failures": [{"local_rank": 0, "rank": 2, "exitcode": 1}]})
    assert stale["accepted"] is False and "stale" in stale["reason"]
    assert stale["restart_count"] == 1


async def test_dropped_long_poll_connection_loses_the_node_after_a_short_grace(server, http):
    a = MsgpackNode(http, server, "job3", "a", min_nodes=1, max_nodes=2, last_call_s=0, lease_timeout_s=30)
    b = MsgpackNode(http, server, "job3", "b", min_nodes=1, max_nodes=2, last_call_s=0, lease_timeout_s=30)
    await a.join()
    joined = await b.join()
    round_id = joined["assignment"]["round_id"]
    async with aiohttp.ClientSession() as doomed:  # b's poll on its own connection, then cut
        b_conn = MsgpackNode(doomed, server, "job3", "b")
        poll = asyncio.create_task(b_conn.poll(known_round=round_id, wait_s=10))
        await wait_until(lambda: server.app[COORDINATOR].hub.open == 1)
        poll.cancel()
    woken = await a.poll(known_round=round_id, wait_s=10)
    for _ in range(5):     # a loaded machine may answer a held poll before the loss is decided: poll on
        if woken["assignment"]["round_id"] > round_id:
            break
        woken = await a.poll(known_round=round_id, wait_s=10)
    assert woken["assignment"]["round_id"] > round_id
    assert woken["assignment"]["world_size"] == 2  # a alone
    assert woken["restart_count"] == 0
    events = await (await http.get(url(server, "/v1/jobs/job3/events"))).json()
    assert any(e["kind"] == "node_lost" and e["node_id"] == "b" for e in events["events"])


async def test_config_conflict_names_both_values(server, http):
    await MsgpackNode(http, server, "job4", "a", min_nodes=2, max_nodes=4).join()
    reply = await MsgpackNode(http, server, "job4", "b", min_nodes=2, max_nodes=3).join(expect=409)
    assert reply["code"] == "config_conflict"
    assert "max_nodes" in reply["message"] and "4" in reply["message"] and "3" in reply["message"]


async def test_finished_job_refuses_joins_saying_how_it_finished(server, http):
    a = MsgpackNode(http, server, "job5", "a")
    assigned = await a.join()
    await a.post("success", {"v": 1, "node_id": "a", "round_id": assigned["assignment"]["round_id"]})
    reply = await MsgpackNode(http, server, "job5", "late").join(expect=410)
    assert reply["code"] == "job_finished" and "succeeded" in reply["message"]


@pytest.mark.parametrize("body, code, needle", [
    (b"\xc1garbage", "bad_request", "MessagePack"),
    (msgpack.packb([1, 2]), "bad_request", "map"),
    (msgpack.packb({"node_id": "a"}), "bad_request", "`v`"),
    (msgpack.packb({"v": 99, "node_id": "a"}), "unsupported_version", "99"),
    (msgpack.packb({"v": 1, "node_id": "a", "addr": "x", "local_world_size": "two", "master_port": 1}),
     "bad_request", "local_world_size"),
    (msgpack.packb({"v": 1, "node_id": "a", "addr": "x", "local_world_size": 0, "master_port": 1}),
     "bad_request", "local_world_size"),
    (msgpack.packb({"v": 1, "node_id": "", "addr": "x", "local_world_size": 1, "master_port": 1}),
     "bad_request", "node_id"),
    (msgpack.packb({"v": 1, "node_id": "a", "addr": "x", "local_world_size": 1, "master_port": 1,
                    "config": {"min_nodes": 3, "max_nodes": 2}}), "bad_request", "max_nodes"),
])
async def test_bad_join_bodies_get_a_typed_error_and_change_nothing(server, http, body, code, needle):
    async with http.post(url(server, "/v1/jobs/badjob/join"), data=body, headers=MSGPACK) as resp:
        reply = msgpack.unpackb(await resp.read())
        assert resp.status == 400
    assert reply["code"] == code and needle in reply["message"]
    assert server.app[COORDINATOR].core.jobs == {}


async def test_oversized_body_is_refused_with_413(server, http):
    async with http.post(url(server, "/v1/jobs/j/join"), data=b"\x00" * (2 << 20), headers=MSGPACK) as resp:
        assert resp.status == 413
        assert msgpack.unpackb(await resp.read())["code"] == "too_large"


async def raw_request(server, head: str, body: bytes = b"") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection that sends `head` (the request line and headers) and `body` in one write, and
    nothing after them."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(head.encode() + b"\r\n" + body)
    await writer.drain()
    return reader, writer


async def reply_of(reader: asyncio.StreamReader) -> tuple[str, bytes]:
    """The status line and body of one reply (its Content-Length body)."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    length = next(int(line.split(":")[1]) for line in head.split("\r\n") if line.lower().startswith("content-length"))
    return head.split("\r\n")[0], await reader.readexactly(length)


@pytest.mark.parametrize("path, content_type", [("/v1/jobs/big/join", "application/msgpack"),
                                                ("/v1/admin/jobs/big/close", "application/json")])
async def test_a_body_announced_over_the_limit_is_refused_at_once_without_reading_it(server, path: str,
                                                                                      content_type: str):
    reader, writer = await raw_request(server, f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                               f"Content-Type: {content_type}\r\nContent-Length: {64 << 20}\r\n")
    try:   # no body is sent: the reply cannot wait for it (the bound only guards against a hang)
        status, body = await asyncio.wait_for(reply_of(reader), 5)
    finally:
        writer.close()
    assert status == "HTTP/1.1 413 Request Entity Too Large"
    reply = msgpack.unpackb(body) if content_type.endswith("msgpack") else json.loads(body)
    assert reply["code"] == "too_large" and f"announces {64 << 20} bytes" in reply["message"]
    assert server.app[COORDINATOR].core.jobs == {}


async def test_a_body_that_does_not_arrive_in_time_is_refused_and_its_connection_closed(server, monkeypatch):
    monkeypatch.setattr(connections, "BODY_TIMEOUT_S", 0.2)
    reader, writer = await raw_request(server, "POST /v1/jobs/slow/join HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                               "Content-Type: application/msgpack\r\nContent-Length: 100\r\n")
    writer.write(b"\x82")                     # one byte of the 100 announced, then nothing
    try:
        status, body = await asyncio.wait_for(reply_of(reader), 5)
        assert status == "HTTP/1.1 400 Bad Request" and "did not arrive within 0.2s" in msgpack.unpackb(body)["message"]
        # closed once the refusal is sent; aiohttp's lingering close would read on for 10 s more
        assert await asyncio.wait_for(reader.read(), 5) == b""
    finally:
        writer.close()


async def test_a_body_that_came_with_its_headers_is_read_without_a_timeout_task(server, monkeypatch):
    # wait_for's task and timer were 7 % of a long-poll's server time at 10,000 nodes; a body already
    # in (every agent request of a few hundred bytes) needs neither, a body still coming keeps them.
    class NoTimeoutTask:          # the module's asyncio, without wait_for
        def __getattr__(self, name: str) -> object:
            return getattr(asyncio, name)

        def wait_for(self, aw: object, _timeout: float) -> None:
            aw.close()            # type: ignore[attr-defined]
            raise AssertionError("a body already received was read through wait_for")
    monkeypatch.setattr(connections, "asyncio", NoTimeoutTask())
    body = msgpack.packb({"v": 1, "node_id": "a", "addr": "127.0.0.1", "local_world_size": 1, "master_port": 1,
                          "config": {"min_nodes": 1, "max_nodes": 1}})
    reader, writer = await raw_request(server, "POST /v1/jobs/whole/join HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                               f"Content-Type: application/msgpack\r\nContent-Length: {len(body)}\r\n",
                                       body)
    try:
        status, reply = await asyncio.wait_for(reply_of(reader), 5)
        assert status == "HTTP/1.1 200 OK" and msgpack.unpackb(reply)["assignment"]["group_world_size"] == 1
    finally:
        writer.close()


async def test_unknown_routes_jobs_and_nodes_are_typed_4xx(server, http):
    async with http.get(url(server, "/v2/nothing")) as resp:
        assert resp.status == 404 and (await resp.json())["code"] == "not_found"
    async with http.get(url(server, "/v1/jobs/nojob")) as resp:
        assert resp.status == 404 and (await resp.json())["code"] == "unknown_job"
    async with http.post(url(server, "/v1/jobs/nojob/fly"), data=b"", headers=MSGPACK) as resp:
        assert resp.status == 404 and msgpack.unpackb(await resp.read())["code"] == "not_found"
    async with http.post(url(server, "/v1/jobs/nojob/join"), data=b"{}",
                         headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 415
    async with http.post(url(server, "/v1/jobs/bad%20id/join"), data=b"", headers=MSGPACK) as resp:
        assert resp.status == 400 and "job id" in msgpack.unpackb(await resp.read())["message"]
    node = MsgpackNode(http, server, "job6", "a")
    await node.join()
    reply = await node.post("failure", {"v": 1, "node_id": "ghost", "round_id": 1,
                                        "failures": [{"local_rank": 0, "rank": 0, "exitcode": 1}]}, expect=404)
    assert reply["code"] == "unknown_node"
    async with http.get(url(server, "/healthz")) as resp:  # still serving
        assert resp.status == 200


async def test_status_and_job_json_show_members_with_ranks(server, http):
    a = MsgpackNode(http, server, "job7", "a", lws=4, min_nodes=1, max_nodes=1)
    await a.join()
    status = await (await http.get(url(server, "/v1/status"))).json()
    (job,) = status["jobs"]
    assert job["job_id"] == "job7" and job["state"] == "running" and job["world_size"] == 4
    assert job["nodes"][0]["node_id"] == "a" and job["nodes"][0]["group_rank"] == 0
    detail = await (await http.get(url(server, "/v1/jobs/job7"))).json()
    assert detail["config"]["max_nodes"] == 1 and detail["restart_count"] == 0
    page = await (await http.get(url(server, "/"))).text()
    assert "job7" in page


async def test_unknown_fields_from_a_newer_agent_are_ignored(server, http):
    body = {"v": 1, "node_id": "new", "addr": "10.0.0.9", "local_world_size": 1, "master_port": 1234,
            "config": {"min_nodes": 1, "max_nodes": 1, "future_knob": True}, "gpu_model": "H200"}
    async with http.post(url(server, "/v1/jobs/job8/join"), data=msgpack.packb(body), headers=MSGPACK) as resp:
        reply = msgpack.unpackb(await resp.read())
        assert resp.status == 200, reply
    assert reply["node_state"] == "member" and reply["assignment"]["master_port"] == 1234


async def test_a_stall_report_over_the_wire_shows_a_rank_alone_and_refuses_a_state_it_does_not_know(server, http):
    """A plain msgpack client: every rank's report of one moment, rank 0 at work alone while the others wait, is
    shown (the reply's `stall`, the job's JSON) and no hang; a state the server does not know is bad_request."""
    a = MsgpackNode(http, server, "alone", "a", min_nodes=2, max_nodes=2, max_restarts=3)
    b = MsgpackNode(http, server, "alone", "b", min_nodes=2, max_nodes=2, max_restarts=3)
    await a.join()
    first = (await b.join())["assignment"]["round_id"]

    def rank(r: int, state: str, **extra: object) -> dict:
        return {"rank": r, "local_rank": r % 2, "state": state, "stalled_s": 9.0, **extra}
    await a.post("stall", {"v": 1, "node_id": "a", "round_id": first, "threshold_s": 5.0, "ranks": [
        rank(0, "working", where="train.py:41 in evaluate"), rank(1, "waiting", call="all_reduce")]})
    reply = await b.post("stall", {"v": 1, "node_id": "b", "round_id": first, "threshold_s": 5.0, "ranks": [
        rank(2, "waiting", call="all_reduce", io_bytes=12, gpu_busy=-1), rank(3, "waiting", call="all_reduce")]})
    assert reply["accepted"] and reply["round_id"] == first and reply["restart_count"] == 0
    assert reply["stall"] == "rank 0 alone for 9s at train.py:41 in evaluate; ranks 1-3 waiting in all_reduce"
    async with http.get(url(server, "/v1/jobs/alone")) as resp:
        view = json.loads(await resp.text())
    assert view["progress"]["stall_kind"] == "alone" and view["progress"]["stall"].startswith("rank 0 alone for")
    async with http.get(url(server, "/v1/jobs/alone/events")) as resp:
        before = json.loads(await resp.text())["last_seq"]
    refused = await b.post("stall", {"v": 1, "node_id": "b", "round_id": first, "threshold_s": 5.0, "ranks": [
        rank(2, "napping"), rank(3, "stopped")]}, expect=400)
    assert refused["code"] == "bad_request" and "state" in refused["message"], refused
    huge = await b.post("stall", {"v": 1, "node_id": "b", "round_id": first, "threshold_s": 5.0, "ranks": [
        rank(2, "stopped", gpu_busy=101), rank(3, "waiting")]}, expect=400)
    assert huge["code"] == "bad_request" and "gpu_busy" in huge["message"], huge
    async with http.get(url(server, "/v1/jobs/alone/events")) as resp:
        after = json.loads(await resp.text())
    assert after["last_seq"] == before and (await a.poll(known_round=first, wait_s=0))["restart_count"] == 0


async def test_a_round_waits_for_a_new_store_port_over_the_wire(server, http):
    """A node hosting a store per round (`store_per_round`) never gets a round on the port of its last one, whose
    store may still listen: the round waits for its next poll's port. A node without the field is not waited for."""
    for job, per_round in (("ports", True), ("one-store", False)):
        a = MsgpackNode(http, server, job, "a", port=1001, min_nodes=2, max_nodes=2, max_restarts=3)
        b = MsgpackNode(http, server, job, "b", port=1002, min_nodes=2, max_nodes=2, max_restarts=3)
        await a.post("join", {"v": 1, "node_id": "a", "addr": "10.0.0.1", "local_world_size": 2, "master_port": 1001,
                              "config": a.config, **({"store_per_round": True} if per_round else {})})
        round1 = (await b.join())["assignment"]
        assert round1["master_port"] == 1001
        waiter = asyncio.create_task(a.poll(known_round=round1["round_id"], wait_s=10))
        reply = await b.post("failure", {"v": 1, "node_id": "b", "round_id": round1["round_id"],
                                         "failures": [{"local_rank": 0, "rank": 2, "exitcode": 1}]})
        woken = await asyncio.wait_for(waiter, 5)
        if not per_round:
            assert reply["assignment"]["master_port"] == woken["assignment"]["master_port"] == 1001
            continue
        for view in (reply, woken):
            assert (view["node_state"], view["assignment"], view["round_id"]) == ("waiting", None, 2), view
            assert "new store port from its group rank 0 (a)" in view["reason"]
        waiter = asyncio.create_task(b.poll(known_round=-1, wait_s=10))
        given = await a.post("poll", {"v": 1, "node_id": "a", "known_round": -1, "wait_s": 0, "master_port": 1005})
        assert given["node_state"] == "member" and given["assignment"]["master_port"] == 1005
        assert (await asyncio.wait_for(waiter, 5))["assignment"]["master_port"] == 1005
