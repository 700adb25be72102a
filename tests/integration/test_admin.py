"""The operator routes under /v1/admin/ on the real app, on loopback.

Agents are spoken for with the plain `msgpack` package (the wire as other clients see it); the
operator side is plain JSON, as curl would send it.
"""
from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import msgpack
import pytest
from aiohttp import web

from protocol.errors import HTTP_STATUS, ErrorCode
from rdzv_server.web.access import is_loopback
from rdzv_server.web.app import COORDINATOR, create_app
from tests.integration.support import remember_credential, start_app, url, with_credential

MSGPACK = {"Content-Type": "application/msgpack"}


class Node:
    """An agent reduced to its wire requests: dicts in, dicts out."""

    def __init__(self, http, server, job: str, node_id: str, port: int, **config) -> None:
        self.http, self.server, self.job, self.node_id, self.port = http, server, job, node_id, port
        self.config = {"lease_timeout_s": 60, "last_call_s": 0, **config}

    async def post(self, action: str, body: dict, expect: int = 200) -> dict:
        body = with_credential(self.server, self.job, {"v": 1, "node_id": self.node_id, **body})
        async with self.http.post(url(self.server, f"/v1/jobs/{self.job}/{action}"),
                                  data=msgpack.packb(body), headers=MSGPACK) as resp:
            reply = msgpack.unpackb(await resp.read())
            assert resp.status == expect, reply
            remember_credential(self.server, self.job, self.node_id, reply)
            return reply

    async def join(self, expect: int = 200) -> dict:
        return await self.post("join", {"addr": f"10.0.0.{self.port % 250}", "local_world_size": 2,
                                        "master_port": self.port, "config": self.config}, expect)

    async def poll(self, known_round: int = -1, wait_s: float = 0.0) -> dict:
        return await self.post("poll", {"known_round": known_round, "wait_s": wait_s})


async def admin(http, server, path: str, body=None, *, expect: int = 200, raw: bytes | None = None,
                content_type: str = "application/json") -> dict:
    data = raw if raw is not None else (b"" if body is None else json.dumps(body).encode())
    async with http.post(url(server, f"/v1/admin/jobs/{path}"), data=data,
                         headers={"Content-Type": content_type}) as resp:
        assert resp.content_type == "application/json"
        reply = await resp.json()
        assert resp.status == expect, reply
        return reply


async def job_json(http, server, job: str) -> dict:
    async with http.get(url(server, f"/v1/jobs/{job}")) as resp:
        return await resp.json()


async def running_job(http, server, job: str, names: tuple[str, ...], **config) -> list[Node]:
    """A job whose round 1 holds every node of `names` (min = max = their count unless given)."""
    config = {"min_nodes": len(names), "max_nodes": len(names), **config}
    nodes = [Node(http, server, job, name, 1000 + i, **config) for i, name in enumerate(names)]
    for node in nodes:
        await node.join()
    assert (await job_json(http, server, job))["round_id"] == 1
    return nodes


async def test_close_ends_the_job_and_agents_see_it_closed(server, http):
    a, b = await running_job(http, server, "closejob", ("a", "b"))
    waiter = asyncio.create_task(a.poll(known_round=1, wait_s=10))
    doc = await admin(http, server, "closejob/close", {"reason": "maintenance window"})
    assert doc["state"] == "closed" and "maintenance window" in doc["reason"]
    assert doc["finished_at"] is not None
    woken = await asyncio.wait_for(waiter, 5)           # an open long-poll learns at once
    assert woken["job_state"] == "closed" and "maintenance window" in woken["reason"]
    assert (await b.poll())["job_state"] == "closed"
    events = await (await http.get(url(server, "/v1/jobs/closejob/events"))).json()
    assert events["events"][-1]["kind"] == "job_closed"
    refused = await admin(http, server, "closejob/close", expect=410)   # no body: reason optional
    assert refused["code"] == "job_finished" and "closed" in refused["message"]


async def test_drain_reforms_the_round_without_the_node_and_refuses_its_join_until_cleared(server, http):
    a, b, c = await running_job(http, server, "drainjob", ("a", "b", "c"), min_nodes=2, last_call_s=30)
    waiter = asyncio.create_task(a.poll(known_round=1, wait_s=10))
    doc = await admin(http, server, "drainjob/nodes/b/drain", {"reason": "flaky NIC"})
    assert [n["node_id"] for n in doc["nodes"]] == ["a", "c"]
    assert doc["round_id"] == 2 and doc["restart_count"] == 0 and doc["world_size"] == 4
    woken = await asyncio.wait_for(waiter, 5)
    assert woken["assignment"]["round_id"] == 2 and woken["assignment"]["group_rank"] == 0
    assert (await b.poll())["node_state"] == "gone"
    refused = await b.join(expect=410)
    assert refused["code"] == "node_drained" and "flaky NIC" in refused["message"]
    events = (await (await http.get(url(server, "/v1/jobs/drainjob/events"))).json())["events"]
    assert any(e["kind"] == "node_drained" and e["node_id"] == "b" for e in events)
    assert events[-1]["kind"] == "round_completed" and events[-1]["data"]["cause"] == "node_drained"

    cleared = await admin(http, server, "drainjob/nodes/b/clear-exclusion")
    assert cleared["round_id"] == 2                      # lifting a drain re-forms nothing by itself
    rejoined = await b.join()
    assert rejoined["node_state"] == "member" and rejoined["assignment"]["round_id"] == 3
    assert rejoined["restart_count"] == 0
    again = await admin(http, server, "drainjob/nodes/b/clear-exclusion", expect=404)
    assert again["code"] == "not_found" and "neither excluded nor drained" in again["message"]


async def test_resize_down_reforms_with_one_node_and_makes_the_other_spare(server, http):
    a, b = await running_job(http, server, "resizejob", ("a", "b"))
    doc = await admin(http, server, "resizejob/resize", {"min_nodes": 1, "max_nodes": 1})
    assert (doc["min_nodes"], doc["max_nodes"], doc["round_id"]) == (1, 1, 2)
    assert [n["node_id"] for n in doc["nodes"]] == ["a"] and doc["world_size"] == 2
    assert [n["node_id"] for n in doc["spares"]] == ["b"] and doc["restart_count"] == 0
    assert (await b.poll())["node_state"] == "spare"
    assert (await a.poll())["assignment"]["round_id"] == 2
    grown = await admin(http, server, "resizejob/resize", {"max_nodes": 2})   # min omitted: kept
    assert (grown["min_nodes"], grown["max_nodes"], grown["round_id"]) == (1, 2, 3)
    assert [n["node_id"] for n in grown["nodes"]] == ["a", "b"] and grown["spares"] == []


async def test_a_form_or_text_content_type_is_refused_as_a_browser_could_send_it(server, http):
    await running_job(http, server, "curljob", ("a",))
    for content_type in ("application/x-www-form-urlencoded", "text/plain"):   # what a cross-site page can send
        doc = await admin(http, server, "curljob/close", raw=b'{"reason": "from curl -d"}',
                          content_type=content_type, expect=415)
        assert doc["code"] == "unsupported_media_type" and "application/json" in doc["message"]
    assert server.app[COORDINATOR].core.jobs["curljob"].state.value == "running"


@pytest.mark.parametrize("path, raw, needle", [
    ("badjob/close", b"{not json", "not valid JSON"),
    ("badjob/close", b"[1, 2]", "JSON object"),
    ("badjob/close", b'{"reason": 5}', "'reason'"),
    ("badjob/close", b'{"reson": "typo"}', "'reson'"),
    ("badjob/close", json.dumps({"reason": "x" * 501}).encode(), "'reason'"),
    ("badjob/nodes/a/drain", b'{"reason": ["a"]}', "'reason'"),
    ("badjob/nodes/a/clear-exclusion", b'{"reason": "x"}', "'reason'"),
    ("badjob/resize", b"{}", "min_nodes"),
    ("badjob/resize", b'{"min_nodes": "1"}', "'min_nodes'"),
    ("badjob/resize", b'{"max_nodes": true}', "'max_nodes'"),
    ("badjob/resize", b'{"max_nodes": 2.5}', "'max_nodes'"),
    ("badjob/resize", b'{"min_nodes": 0}', "min_nodes"),
    ("badjob/resize", b'{"min_nodes": 3, "max_nodes": 2}', "max_nodes"),
    ("badjob/nodes/bad%20node/drain", b"", "node id"),
    ("bad%20job/close", b"", "job id"),
])
async def test_bad_requests_are_400_json_naming_the_field_and_change_nothing(server, http, path, raw, needle):
    await running_job(http, server, "badjob", ("a", "b"))
    before = await job_json(http, server, "badjob")
    reply = await admin(http, server, path, raw=raw, expect=400)
    assert reply["code"] == "bad_request" and needle in reply["message"], reply
    after = await job_json(http, server, "badjob")
    assert {k: v for k, v in after.items() if k not in ("nodes", "spares")} == \
        {k: v for k, v in before.items() if k not in ("nodes", "spares")}


async def test_unknown_jobs_nodes_and_routes_are_json_errors(server, http):
    for path, body in (("nojob/close", None), ("nojob/nodes/a/drain", None),
                       ("nojob/nodes/a/clear-exclusion", None), ("nojob/resize", {"max_nodes": 2})):
        reply = await admin(http, server, path, body, expect=404)
        assert reply["code"] == "unknown_job" and "nojob" in reply["message"]
    await running_job(http, server, "known", ("a",))
    # a node the job does not hold now (lost, or not yet come) may be drained ahead: it is kept out
    reply = await admin(http, server, "known/nodes/ghost/drain", {"reason": "bad host"}, expect=200)
    assert reply["drained"] == [{"node_id": "ghost", "reason": "bad host"}] and reply["round_id"] == 1
    reply = await admin(http, server, "known/fly", expect=404)
    assert reply["code"] == "not_found"
    async with http.get(url(server, "/v1/admin/jobs/known/close")) as resp:
        assert resp.status == 405 and (await resp.json())["code"] == "method_not_allowed"
    async with http.post(url(server, "/v1/jobs/known/fly"), data=b"", headers=MSGPACK) as resp:
        assert resp.status == 404 and msgpack.unpackb(await resp.read())["code"] == "not_found"  # agents: msgpack


def with_peer(app: web.Application, peer: str) -> web.Application:
    """Make every request look as if it came from `peer`, as a reverse proxy's middleware would."""
    @web.middleware
    async def fake_peer(request: web.Request, handler):
        return await handler(request.clone(remote=peer))
    app.middlewares.insert(0, fake_peer)
    return app


@pytest.mark.parametrize("peer", ["10.1.2.3", "2001:db8::7"])
async def test_admin_from_a_non_loopback_peer_is_forbidden_unless_allowed(http, peer):
    srv = await start_app(with_peer(create_app(), peer))
    try:
        await running_job(http, srv, "remote", ("a",))
        reply = await admin(http, srv, "remote/close", {"reason": "x"}, expect=403)
        assert reply["code"] == "forbidden"
        assert peer in reply["message"] and "--allow-remote-admin" in reply["message"]
        reply = await admin(http, srv, "remote/nodes/a/drain", expect=403)
        assert reply["code"] == "forbidden"
        assert srv.app[COORDINATOR].core.jobs["remote"].state.value == "running"
        async with http.get(url(srv, "/v1/jobs/remote")) as resp:   # reading stays open to all
            assert resp.status == 200
    finally:
        await srv.close()
    allowed = await start_app(with_peer(create_app(allow_remote_admin=True), peer))
    try:
        await running_job(http, allowed, "remote", ("a",))
        assert (await admin(http, allowed, "remote/close", {"reason": "x"}))["state"] == "closed"
    finally:
        await allowed.close()


@pytest.mark.parametrize("addr, loopback", [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("::ffff:127.0.0.1", True),
    ("10.0.0.1", False), ("0.0.0.0", False), ("::ffff:10.0.0.1", False), ("fe80::1%eth0", False),
    ("", False), (None, False), ("not-an-address", False),
])
def test_is_loopback(addr, loopback):
    assert is_loopback(addr) is loopback


async def test_the_operators_guides_admin_examples_answer_as_it_shows(server, http):
    # A review: the guide showed a drain of a node not in the job answered 404 unknown_node, which no admin route
    # answers (such a drain is accepted: the node is kept out if it comes). Its curl examples, replayed in order
    # on a job of two nodes: each answer shown is the one the server gives.
    await running_job(http, server, "bert-large", ("node-a", "node-b"))
    guide = (Path(__file__).parents[2] / "docs" / "operators.md").read_text()
    lines = guide[guide.index("## Changing: the admin routes"):guide.index("## `rdzv-ctl`")].splitlines()
    shown = 0
    for line, after in zip(lines, lines[1:] + [""], strict=True):
        m = re.match(r"\$ curl .*localhost:29400/v1/admin/jobs/(\S+)(?: -d '(.*)')?$", line)
        if m is None:
            continue
        body = json.loads(m[2]) if m[2] else None
        if after.startswith("{"):
            expected = json.loads(after)
            reply = await admin(http, server, m[1], body, expect=HTTP_STATUS[ErrorCode(expected["code"])])
            assert reply == expected, (line, reply)
            shown += 1
        else:
            await admin(http, server, m[1], body)
    assert shown == 2
    codes = [row.split("|")[1] for row in lines if row.startswith("| 4")]      # the errors table's first column
    assert codes and not any("unknown_node" in c for c in codes), codes
