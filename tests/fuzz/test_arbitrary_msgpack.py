"""Arbitrary MessagePack to every agent route of the real app: never a 5xx, always a clear 400.

The values are trees of every MessagePack type: nil, booleans, integers over the whole 64-bit range
(unsigned too), floats, strings (valid UTF-8 or not), binary, extension types, arrays and maps whose
keys are of any type (an extension type, an array, a map), and nesting deep enough to reach a decoder's
limit. They are written by `pack` below, not by a MessagePack library (which refuses to write some of
them), with or without a valid `v` beside them so that both of the server's decodes are reached.
"""
from __future__ import annotations

import struct
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.codec import REQUEST_TYPES
from protocol.messages import PROTOCOL_VERSION
from tests.fuzz.inprocess import ServerThread
from tests.fuzz.rawhttp import Connection, request_bytes

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


class Raw:
    """Bytes written into the body as they are (a string that is not valid UTF-8)."""

    def __init__(self, data: bytes) -> None:
        self.data = data


class Ext:
    def __init__(self, code: int, data: bytes) -> None:
        self.code, self.data = code, data


class Map:
    """A map as a list of pairs: its keys may be of any type, hashable or not."""

    def __init__(self, pairs: list[tuple[Any, Any]]) -> None:
        self.pairs = pairs


def pack(value: Any) -> bytes:
    """MessagePack's encoding of `value`, written by hand (only the long forms: every decoder takes them)."""
    if value is None:
        return b"\xc0"
    if value is True or value is False:
        return b"\xc3" if value else b"\xc2"
    if isinstance(value, int):
        return b"\xcf" + struct.pack(">Q", value) if value >= 0 else b"\xd3" + struct.pack(">q", value)
    if isinstance(value, float):
        return b"\xcb" + struct.pack(">d", value)
    if isinstance(value, str):
        data = value.encode("utf-8", "surrogatepass")
        return b"\xdb" + struct.pack(">I", len(data)) + data
    if isinstance(value, Raw):
        return b"\xdb" + struct.pack(">I", len(value.data)) + value.data
    if isinstance(value, bytes):
        return b"\xc6" + struct.pack(">I", len(value)) + value
    if isinstance(value, Ext):
        return b"\xc9" + struct.pack(">Ib", len(value.data), value.code) + value.data
    if isinstance(value, list):
        return b"\xdd" + struct.pack(">I", len(value)) + b"".join(pack(v) for v in value)
    if isinstance(value, Map):
        return b"\xdf" + struct.pack(">I", len(value.pairs)) + b"".join(pack(k) + pack(v) for k, v in value.pairs)
    raise TypeError(value)


scalars = (st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 64 - 1) | st.floats()
           | st.text(max_size=20) | st.binary(max_size=20).map(Raw) | st.binary(max_size=20)
           | st.builds(Ext, st.integers(-128, 127), st.binary(max_size=8)))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.lists(st.tuples(inner, inner), max_size=4).map(Map), max_leaves=24)
FIELDS = ["v", "job_id", "node_id", "credential", "round_id", "failures", "config", "addr", "local_world_size",
          "known_round", "wait_s", "reason", "instance", "host"]
keys = st.sampled_from(FIELDS) | values


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    """A map of fields (some of the protocol's names, some anything) and values of every type; sometimes
    with the right `v`, sometimes a deep nest or a value that is not a map at all."""
    shape = draw(st.sampled_from(["map", "map", "map", "deep", "other"]))
    if shape == "deep":
        depth = draw(st.integers(100, 5000))
        return b"\x81\xa1v\x01" + b"\x82\xa1v\x01\xa1x" + b"\x91" * depth + b"\xc0"
    if shape == "other":
        return pack(draw(values))
    pairs = draw(st.lists(st.tuples(keys, values), max_size=6))
    if draw(st.booleans()):
        pairs.insert(draw(st.integers(0, len(pairs))), ("v", PROTOCOL_VERSION))
    return pack(Map(pairs))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    thread = ServerThread(str(tmp_path_factory.mktemp("state")))
    yield thread
    thread.close()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=bodies(), action=st.sampled_from(sorted(REQUEST_TYPES)))
def test_any_messagepack_body_gets_a_clear_400(server, body, action):
    conn = Connection("127.0.0.1", server.port)
    try:
        reply = conn.send(request_bytes("POST", f"/v1/jobs/fuzz-any/{action}",
                                        [("Content-Type", "application/msgpack")], body,
                                        host=f"127.0.0.1:{server.port}"))
    finally:
        conn.close()
    assert reply.status < 500, (action, body[:200], reply.status, reply.body[:300])
    if reply.status != 200:     # a join may be valid by chance; anything else is refused, saying why
        error = msgpack.unpackb(reply.body) if reply.content_type == "application/msgpack" else None
        assert isinstance(error, dict) and error.get("message"), (reply.status, reply.body[:300])
        assert (reply.status, error["code"]) in ((400, "bad_request"), (400, "unsupported_version"),
                                                 (404, "unknown_job"), (413, "too_large")), error
