"""The fuzzers' own parts find what they are meant to find (a fuzzer that cannot fail proves nothing)."""
from __future__ import annotations

import json

import msgpack
import msgspec
import pytest

from tests.fuzz import oracle, payloads
from tests.fuzz.inprocess import ServerThread, differences
from tests.fuzz.rawhttp import Connection, Reply, request_bytes
from tests.fuzz.requests import Request
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
