"""The fuzzers' own parts find what they are meant to find (a fuzzer that cannot fail proves nothing)."""
from __future__ import annotations

import json
from dataclasses import replace

import msgpack
import msgspec
import pytest

from tests.fuzz import oracle, payloads
from tests.fuzz.inprocess import ServerThread, differences
from tests.fuzz.rawhttp import Connection, Reply, request_bytes
from tests.fuzz.requests import MSGPACK, Request, valid_body
from tests.fuzz.soak_client import FuzzClient

AGENT = Request("POST", "/v1/jobs/j/join", (), b"", "t", "agent", field="config.min_nodes")
VIEW = Request("GET", "/", (), b"", "t", "view")


def error_reply(status: int, code: str, message: str) -> Reply:
    return Reply(status, "", [("Content-Type", "application/msgpack")],
                 msgpack.packb({"code": code, "message": message}))


def test_the_oracle_flags_5xx_tracebacks_unnamed_fields_and_loose_json():
    assert oracle.problems(AGENT, error_reply(400, "bad_request", "Expected `int` - at `$.config.min_nodes`")) == []
    assert "HTTP 500" in oracle.problems(AGENT, error_reply(500, "internal", "internal server error"))
    assert any("one line" in p for p in oracle.problems(AGENT, error_reply(400, "bad_request", "a\nmin_nodes")))
    assert any("name the field" in p for p in oracle.problems(AGENT, error_reply(400, "bad_request", "bad body")))
    assert any("the table says 400" in p for p in oracle.problems(AGENT, error_reply(409, "bad_request", "min_nodes")))
    loose = Reply(200, "", [("Content-Type", "application/json")], b'{"x": NaN}')
    assert any("strict JSON" in p for p in oracle.problems(VIEW, loose))
    page = Reply(200, "", [("Content-Type", "text/html")], b"<p><script>alert('fz')</script></p>")
    assert any("unescaped" in p for p in oracle.problems(VIEW, page))


def test_spliced_values_reach_the_wire_as_written():
    body = payloads.packb({"v": 1, "addr": payloads.INVALID_UTF8[0], "deep": payloads.nested_lists(3),
                           "dup": payloads.Pairs([("k", 1), ("k", 2)])})
    with pytest.raises(UnicodeDecodeError):
        msgpack.unpackb(body)
    assert b"\x91\x91\x91\xc0" in body and b"\x82\xa1k\x01\xa1k\x02" in body
    assert payloads.json_body({"reason": payloads.Raw(b"NaN", "NaN")}) == b'{"reason": NaN}'


def test_a_changed_job_is_a_difference(tmp_path):
    server = ServerThread(str(tmp_path / "state"))
    try:
        conn = Connection("127.0.0.1", server.port)
        join = msgpack.packb({"v": 1, "node_id": "a", "addr": "10.0.0.1", "local_world_size": 1, "master_port": 1})
        assert conn.send(request_bytes("POST", "/v1/jobs/j/join", [("Content-Type", "application/msgpack")], join,
                                       host="127.0.0.1")).status == 200
        before = server.snapshot(["j"])
        record = server.job("j")
        assert record is not None and msgspec.msgpack.encode(record) == before.records["j"]
        drained = conn.send(request_bytes("POST", "/v1/admin/jobs/j/nodes/a/drain", [
            ("Content-Type", "application/json")], b"{}", host="127.0.0.1"))
        assert drained.status == 200, drained
        changed = differences(before, server.snapshot(["j"]))
        assert any(line.startswith("job j.nodes:") for line in changed), changed
        conn.close()
    finally:
        server.close()


def test_the_soak_client_notices_a_canary_changed_behind_its_back(tmp_path):
    server = ServerThread(str(tmp_path / "state"))
    try:
        client = FuzzClient(server.port, 0, hang_s=20)
        client.check_canary(None, None)
        assert client.problems == {}
        conn = Connection("127.0.0.1", server.port)
        resized = conn.send(request_bytes("POST", f"/v1/admin/jobs/{client.ctx.job_id}/resize", [
            ("Content-Type", "application/json")], json.dumps({"max_nodes": 3}).encode(), host="127.0.0.1"))
        conn.close()
        assert resized.status == 200, resized
        client.check_canary(None, None)
        assert list(client.problems) == ["refused request changed the state"], client.problems
    finally:
        server.close()


def test_the_soak_client_tells_a_lost_reply_rejoin_from_a_forgery(tmp_path):
    server = ServerThread(str(tmp_path / "state"))
    try:
        client = FuzzClient(server.port, 0, hang_s=20)
        node = client.ctx.nodes[0]
        old_secret = node.credential

        def join(credential: str | None) -> Request:
            body = valid_body(client.ctx, "join", replace(node, credential=credential))
            return Request("POST", f"/v1/jobs/{client.ctx.job_id}/join", (("Content-Type", MSGPACK),),
                           payloads.packb(body), "t.join", "agent", job_id=client.ctx.job_id,
                           node_id=node.node_id, action="join", forged=credential is None, host=client.authority)

        client.fire(join(None))          # its own instance, the secret never used: a fresh secret, no problem
        assert client.problems == {} and client.lost_reply_rejoins == 1 and client.forged_accepted == 0
        fresh = client.ctx.nodes[0].credential
        assert fresh and fresh != old_secret
        client.fire(join(fresh))         # the fresh secret carried and accepted: proven from now on
        assert client.proven == {node.node_id} and client.problems == {}
        client.fire(join(None))          # now the server refuses it (node_conflict): nothing to report
        assert client.problems == {} and client.lost_reply_rejoins == 1
        client.proven.clear()            # as if the soak had missed the proof: a refused join is no problem either
        client.fire(join(None))
        assert client.problems == {} and client.forged_accepted == 0
    finally:
        server.close()
