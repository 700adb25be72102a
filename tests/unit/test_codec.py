"""The wire codec (protocol/codec.py) and the field rules (protocol/messages.py, ids.py, tokens.py):
every refusal is a DecodeError naming what was wrong, never another exception."""
from __future__ import annotations

import msgpack
import pytest

from protocol.bounds import MAX_NODES
from protocol.codec import MAX_BODY_BYTES, DecodeError, decode_reply, decode_request, encode
from protocol.errors import ErrorCode
from protocol.ids import job_id_problem, node_id_problem
from protocol.messages import FailureReport, JobConfig, JoinRequest, LeaveRequest, NodeState, NodeStatus, PollRequest
from protocol.tokens import token_problem

JOIN = {"v": 1, "node_id": "a", "addr": "10.0.0.1", "local_world_size": 1, "master_port": 1}


def refused(cls, body: bytes) -> DecodeError:
    with pytest.raises(DecodeError) as err:
        decode_request(cls, body)
    return err.value


def test_a_good_request_decodes_in_one_typed_pass_and_round_trips():
    req = decode_request(JoinRequest, msgpack.packb({**JOIN, "config": {"min_nodes": 2, "max_nodes": 4}}))
    assert req.config == JobConfig(min_nodes=2, max_nodes=4) and req.credential == ""
    status = NodeStatus(job_id="j", job_state="waiting", node_state=NodeState.WAITING, round_id=-1, restart_count=0)
    assert decode_reply(encode(status)) == status


@pytest.mark.parametrize("body, code, needle", [
    (msgpack.packb({**JOIN, "v": 2}), ErrorCode.UNSUPPORTED_VERSION, "version 2"),
    (msgpack.packb({**JOIN, "v": "1"}), ErrorCode.UNSUPPORTED_VERSION, "'1'"),
    (msgpack.packb({"node_id": "a"}), ErrorCode.BAD_REQUEST, "`v`"),
    (msgpack.packb([1]), ErrorCode.BAD_REQUEST, "map"),
    (b"\xc1", ErrorCode.BAD_REQUEST, "MessagePack"),
    (b"\x81\xa1v\xd9\x02\xff\xfe", ErrorCode.BAD_REQUEST, "MessagePack"),           # invalid UTF-8
    (b"\x91" * 100_000 + b"\x01", ErrorCode.BAD_REQUEST, "map"),                  # nested 100,000 deep: no map
    (b"\x81\xa1x" + b"\x91" * 100_000 + b"\x01", ErrorCode.BAD_REQUEST, "MessagePack"),   # ... in a field
    (msgpack.packb({**JOIN, "local_world_size": 2 ** 64 - 1}), ErrorCode.BAD_REQUEST, "local_world_size"),
    (msgpack.packb({**JOIN, "config": {"max_nodes": MAX_NODES + 1}}), ErrorCode.BAD_REQUEST, "max_nodes"),
    (msgpack.packb({**JOIN, "config": {"last_call_s": float("inf")}}), ErrorCode.BAD_REQUEST, "last_call_s"),
    (msgpack.packb({**JOIN, "config": {"exclude_window_s": float("nan")}}), ErrorCode.BAD_REQUEST, "exclude_window"),
    (msgpack.packb({**JOIN, "addr": "10.0.0.1\n12:00 info job succeeded"}), ErrorCode.BAD_REQUEST, "control"),
    (msgpack.packb({**JOIN, "host": "x" * 300}), ErrorCode.BAD_REQUEST, "host"),
    (msgpack.packb({**JOIN, "node_id": "a/b"}), ErrorCode.BAD_REQUEST, "node_id"),
    (msgpack.packb({**JOIN, "credential": "c" * 65}), ErrorCode.BAD_REQUEST, "credential"),
])
def test_bad_bodies_are_refused_naming_what_was_wrong(body, code, needle):
    err = refused(JoinRequest, body)
    assert err.code == code and needle in err.message, err.message
    assert len(err.message) < 400                      # quoting what a client sent, bounded


def test_failure_reports_bound_their_size_and_their_timestamps():
    base = {"v": 1, "node_id": "a", "round_id": 1}
    assert "failures" in refused(FailureReport, msgpack.packb({**base, "failures": []})).message
    bad_time = {"local_rank": 0, "rank": 0, "exitcode": 1, "timestamp": 1e300}
    assert "timestamp" in refused(FailureReport, msgpack.packb({**base, "failures": [bad_time]})).message
    too_long = {"local_rank": 0, "rank": 0, "exitcode": 1, "message": "m" * 5000}
    assert "message" in refused(FailureReport, msgpack.packb({**base, "failures": [too_long]})).message
    assert "wait_s" in refused(PollRequest, msgpack.packb({"v": 1, "node_id": "a", "wait_s": 61})).message
    assert "reason" in refused(LeaveRequest, msgpack.packb({"v": 1, "node_id": "a", "reason": "\x1b[2J"})).message


def test_a_body_over_the_limit_is_refused_before_it_is_read():
    assert refused(JoinRequest, b"\x00" * (MAX_BODY_BYTES + 1)).code == ErrorCode.TOO_LARGE


def test_the_id_and_token_rules_are_one_each_and_say_why():
    assert job_id_problem("run-17") == "" and "job id must be" in job_id_problem("a b")
    assert node_id_problem("node@host:1") == "" and "node id must be" in node_id_problem("-x")
    assert token_problem(b"0123456789abcdef") == ""
    assert "at least 16" in token_problem(b"short") and "printable" in token_problem(b"with a space 0123456")


@pytest.mark.parametrize("error", [TypeError("unhashable type: 'msgspec.msgpack.Ext'"), ValueError("odd"),
                                   OverflowError("big"), RecursionError()])
def test_whatever_a_decoder_raises_on_a_body_is_a_bad_request(monkeypatch, error):
    """msgspec 0.18 (the floor pyproject allows) raises TypeError for a map key it cannot hash; any
    version may raise something else on a hostile body: it is the client's error, never the server's."""
    from protocol import codec

    class Raising:
        def decode(self, body: bytes) -> object:
            raise error

    monkeypatch.setattr(codec, "_any_decoder", Raising())
    monkeypatch.setitem(codec._request_decoders, JoinRequest, Raising())
    with pytest.raises(DecodeError) as caught:
        decode_request(JoinRequest, b"\x81\xa1v\x01")
    assert caught.value.code is ErrorCode.BAD_REQUEST
    assert caught.value.message.startswith("body is not valid MessagePack")


@pytest.mark.parametrize("body", [
    b"\xdd\x00\x0f\xff\xf0" + b"\x80" * ((1 << 20) - 16),                  # an array of 1M empty maps
    b"\x81\xa1x\xdd\x00\x0f\xff\xe0" + b"\x90" * ((1 << 20) - 32),          # a field of 1M empty arrays
    b"\x81\xa1v\xdd\x00\x0f\xff\xe0" + b"\x90" * ((1 << 20) - 32),          # ... as the version itself
])
def test_a_refused_body_is_not_built_into_objects_to_find_its_version(body):
    """A body of 1 MiB built untyped, to read its version, was a million Python objects: ~70 MB and 0.2-0.3 s of the
    server's one event loop for each such request (a review: a stranger's 11 a second held the loop, its lag up to
    0.55 s, while 1 MiB bodies of plain bytes at 600 a second left it at 0.04 s). The refusal builds none of them."""
    import tracemalloc
    tracemalloc.start()
    try:
        err = refused(JoinRequest, body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert err.code is ErrorCode.BAD_REQUEST and len(err.message) < 400
    assert peak < 4 << 20, f"{peak >> 20} MiB to refuse a body of 1 MiB"
