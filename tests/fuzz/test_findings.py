"""Minimal reproducers of what the fuzzers found, one request each (see known_issues.py).

An open finding is marked xfail(strict=True): the suite stays green while it is open, and goes red
the moment the server is fixed until the marker is removed (with its entry in known_issues.py).
"""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time

import msgpack
import pytest

from tests.fuzz.inprocess import ServerThread
from tests.fuzz.rawhttp import Connection, NoReply, Reply, request_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def post(server: ServerThread, path: str, body: bytes, content_type: str = "application/msgpack") -> Reply:
    conn = Connection("127.0.0.1", server.port)
    try:
        return conn.send(request_bytes("POST", path, [("Content-Type", content_type)], body,
                                       host=f"127.0.0.1:{server.port}"))
    finally:
        conn.close()


@pytest.mark.parametrize("path, body, content_type", [
    ("/v1/jobs/j/join", msgpack.packb({"v": "a" * 200_000, "node_id": "n"}), "application/msgpack"),
    ("/v1/admin/jobs/j/resize", json.dumps({"min_nodes": "r" * 200_000}).encode(), "application/json"),
    ("/v1/admin/jobs/j/close", json.dumps({"reason": ["r" * 200_000]}).encode(), "application/json")])
def test_a_refusal_does_not_echo_a_huge_value_whole(server, path, body, content_type):
    reply = post(server, path, body, content_type)
    error = msgpack.unpackb(reply.body) if reply.content_type == "application/msgpack" else json.loads(reply.body)
    assert reply.status == 400, error
    assert len(error["message"]) <= 1000, len(error["message"])


def join(server: ServerThread, job: str, node: str) -> Reply:
    return post(server, f"/v1/jobs/{job}/join", msgpack.packb({
        "v": 1, "node_id": node, "addr": "10.0.0.1", "local_world_size": 1, "master_port": 1000,
        "config": {"min_nodes": 2, "max_nodes": 2}}))


@pytest.mark.parametrize("path", ["/v1/admin/jobs/j/close", "/v1/admin/jobs/j/nodes/a/drain"])
def test_a_lone_surrogate_in_an_admin_reason_is_refused_or_kept(server, path):
    assert join(server, "j", "a").status == 200
    refused_or_kept = post(server, path, b'{"reason": "x\\ud800"}', "application/json")
    assert refused_or_kept.status in (200, 400), refused_or_kept
    other = join(server, "k", "b")      # and no other job is affected
    assert other.status == 200, other.body


@pytest.mark.parametrize("method, path", [
    ("POST", "/v1//jobs/a%0D%0AX-Injected:%201/join"), ("GET", "/v1/jobs/a%0D%0Ab/join"),
    ("POST", "/v1/jobs//" + "x" * 3000), ("POST", "/v1/jobs/j/" + "x" * 3000),
    ("POST", "/v1/admin/jobs/" + "a" * 3000 + "/close"), ("POST", "/v1/admin/jobs/j/nodes/" + "-" * 3000 + "/drain"),
    ("GET", "/v1/jobs/" + "a" * 3000)])
def test_errors_about_the_path_quote_it_short_and_on_one_line(server, method, path):
    conn = Connection("127.0.0.1", server.port)
    try:
        reply = conn.send(request_bytes(method, path, [("Content-Type", "application/json")], b"",
                                        host=f"127.0.0.1:{server.port}"))
    finally:
        conn.close()
    error = msgpack.unpackb(reply.body) if reply.content_type == "application/msgpack" else json.loads(reply.body)
    assert 400 <= reply.status < 500, reply
    assert "\n" not in error["message"] and "\r" not in error["message"], error
    assert len(error["message"]) <= 1000, len(error["message"])


@pytest.mark.parametrize("method, path", [("POST", "/v1/jobs/j/join"), ("GET", "/v1/status"),
                                          ("POST", "/v1/admin/jobs/j/close")])
def test_a_non_utf8_authorization_header_is_refused_not_a_500(server, method, path):
    conn = Connection("127.0.0.1", server.port)
    try:
        reply = conn.send(request_bytes(method, path, [("Content-Type", "application/json"),
                                                       ("Authorization", b"Bearer \xe9")], b"{}",
                                        host=f"127.0.0.1:{server.port}"))
    finally:
        conn.close()
    assert reply.status < 500, reply


def join_reply(server: ServerThread, job: str, node: str, **config) -> dict:
    return msgpack.unpackb(post(server, f"/v1/jobs/{job}/join", msgpack.packb({
        "v": 1, "node_id": node, "addr": "10.0.0.1", "local_world_size": 1, "master_port": 1000,
        "config": {"min_nodes": 1, "max_nodes": 1, **config}})).body)


@pytest.mark.parametrize("how", ["drain", "close", "worker message"])
def test_client_text_with_a_line_break_does_not_break_later_error_messages(server, how):
    first = join_reply(server, "j", "a")
    if how == "drain":
        post(server, "/v1/admin/jobs/j/nodes/a/drain", b'{"reason": "a\\njob succeeded: all 64 nodes"}',
             "application/json")
    elif how == "close":
        post(server, "/v1/admin/jobs/j/close", b'{"reason": "a\\njob succeeded: all 64 nodes"}', "application/json")
    else:
        status = msgpack.unpackb(post(server, "/v1/jobs/j/failure", msgpack.packb({
            "v": 1, "node_id": "a", "round_id": first["round_id"], "credential": first.get("credential"),
            "failures": [{"local_rank": 0, "rank": 0, "exitcode": 1, "message": "a\njob succeeded: all 64 nodes"}]}
        )).body)
        assert "\n" not in status["reason"], status["reason"]        # every agent of the job prints it
    refused = join_reply(server, "j", "a")
    assert refused["code"] in ("node_drained", "job_finished"), refused
    assert "\n" not in refused["message"], refused["message"]


def counted(server: ServerThread, route: str) -> dict[str, float]:
    """rdzv_http_requests_total of one route template, by status."""
    conn = Connection("127.0.0.1", server.port)
    try:
        text = conn.send(request_bytes("GET", "/metrics", [], host=f"127.0.0.1:{server.port}",
                                       content_length=False)).body.decode()
    finally:
        conn.close()
    found = re.findall(r'rdzv_http_requests_total\{method="POST",route="' + re.escape(route) +
                       r'",status="(\d+)"\} ([\d.e+]+)', text)
    return {status: float(n) for status, n in found}


def test_a_client_gone_mid_body_is_not_an_internal_error(server, caplog):
    caplog.set_level(logging.INFO, logger="rdzv_server")
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(request_bytes("POST", "/v1/jobs/j/join", [("Content-Type", "application/msgpack"),
                                                          ("Content-Length", "100")], b"\x82\xa1v\x01",
                               host="127.0.0.1", content_length=False))
    sock.close()
    deadline = time.monotonic() + 10
    while not counted(server, "/v1/jobs/{job_id}/join"):       # the server is done with the request
        assert time.monotonic() < deadline, "the request was never counted"
        time.sleep(0.01)
    assert "500" not in counted(server, "/v1/jobs/{job_id}/join")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text[:2000]


@pytest.fixture
def server_process(tmp_path):
    """A real rdzv-server (its own logging set up as in production): (port, a function that stops it and
    returns its stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", "rdzv_server.cli", "--host", "127.0.0.1", "--port", "0",
                             "--state-dir", str(tmp_path / "state")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout is not None
        port = int(re.search(r":(\d+)\s*$", proc.stdout.readline()).group(1))

        def stop() -> str:
            proc.send_signal(signal.SIGTERM)
            return proc.communicate(timeout=20)[1]
        yield port, stop
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_body_that_does_not_decode_logs_no_traceback(server_process):
    port, stop = server_process
    conn = Connection("127.0.0.1", port)
    try:
        reply = conn.send(request_bytes("POST", "/v1/jobs/j/join", [("Content-Type", "application/msgpack"),
                                                                    ("Content-Encoding", "deflate")],
                                        b"\xff" * 64, host=f"127.0.0.1:{port}"))
        assert reply.status == 415, reply
        try:            # the next request on the connection: the server has dealt with the body before it
            conn.send(request_bytes("GET", "/healthz", [], host=f"127.0.0.1:{port}", content_length=False))
        except NoReply:
            pass
    finally:
        conn.close()
    log = stop()
    assert " error " not in log and "Traceback" not in log, log[-3000:]


def test_the_log_quotes_c1_controls_and_unicode_line_separators(server_process):
    # A leave's reason may not hold them (the protocol refuses non-printable text there); a worker's
    # error message and an operator's reason may, and both reach the log.
    port, stop = server_process
    unsafe = "x\x85y\x9b2Jz\u2028w\u2029v"
    conn = Connection("127.0.0.1", port)
    try:
        def send(path: str, doc: dict, content_type: str = "application/msgpack") -> Reply:
            body = json.dumps(doc).encode() if content_type == "application/json" else msgpack.packb(doc)
            return conn.send(request_bytes("POST", path, [("Content-Type", content_type)], body,
                                           host=f"127.0.0.1:{port}"))
        joined = msgpack.unpackb(send("/v1/jobs/j/join", {
            "v": 1, "node_id": "a", "addr": "10.0.0.1", "local_world_size": 1, "master_port": 1000,
            "config": {"max_restarts": 1}}).body)
        failed = send("/v1/jobs/j/failure", {"v": 1, "node_id": "a", "round_id": joined["round_id"],
                                             "credential": joined["credential"],
                                             "failures": [{"local_rank": 0, "rank": 0, "exitcode": 1,
                                                           "message": unsafe}]})
        assert failed.status == 200, failed
        closed = send("/v1/admin/jobs/j/close", {"reason": unsafe}, "application/json")
        assert closed.status == 200, closed
    finally:
        conn.close()
    log = stop()
    assert "worker failure on a" in log and "closed by operator" in log, log
    assert not any(c in log for c in "\x85\x9b\u2028\u2029"), [ln for ln in log.split("\n") if "x" in ln]
    assert "x\\x85y\\x9b2Jz\\u2028w\\u2029v" in log, log     # shown escaped, not dropped
