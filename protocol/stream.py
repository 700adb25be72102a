"""The stream: one WebSocket per node (`GET /v1/jobs/{job_id}/stream`), MessagePack frames both ways.

Every frame is one binary WebSocket message holding one MessagePack map whose `t` key names its
type (docs/protocol.md, "The stream"). The node sends `hello` first, then its requests (the same
request maps as the HTTP routes, with an id), `subscribe` once joined, and a `heartbeat` every
`lease_timeout_s / 3`; the server answers each request with a `reply` of the same id and pushes a
`status` whenever the node's view changes. A fatal `error` frame precedes the server closing it.
"""
from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from protocol.errors import ErrorCode
from protocol.ids import NODE_ID, NODE_ID_RULE
from protocol.messages import MAX_CREDENTIAL, MAX_ROUND, ErrorReply, NodeStatus, Port, RoundRef
from protocol.quoting import quote

STREAM_VERSION = 1                    # the stream's own version (advertised by /healthz as "stream")
STREAM_PATH = "stream"                # /v1/jobs/{job_id}/stream
MAX_FRAME_BYTES = (1 << 20) + 4096    # a request body (codec.MAX_BODY_BYTES) and its frame's envelope
RequestId = Annotated[int, Meta(ge=0, le=MAX_ROUND)]


class Hello(msgspec.Struct, tag="hello", tag_field="t", kw_only=True):
    """First frame of a stream: which node it speaks for (every later frame is that node's)."""
    v: int
    node_id: str

    def __post_init__(self) -> None:
        if not NODE_ID.fullmatch(self.node_id):
            raise ValueError(f"node_id: must be {NODE_ID_RULE}, got {quote(self.node_id)}")


class Request(msgspec.Struct, tag="request", tag_field="t", kw_only=True):
    """One request, as on HTTP: `action` names it (join, failure, success, leave), `body` is its map."""
    id: RequestId
    action: Annotated[str, Meta(max_length=16)]
    body: msgspec.Raw


class Subscribe(msgspec.Struct, tag="subscribe", tag_field="t", kw_only=True):
    """Push this node's view from now on (sent after the join; again to publish a new master_port).
    While subscribed the stream is the node's lease, as a held long-poll is."""
    credential: Annotated[str, Meta(max_length=MAX_CREDENTIAL)] = ""
    known_round: RoundRef = -1
    master_port: Port = 0


class Heartbeat(msgspec.Struct, tag="heartbeat", tag_field="t", kw_only=True):
    """The node is alive (every lease_timeout_s / 3); any frame counts the same."""


class Reply(msgspec.Struct, tag="reply", tag_field="t", kw_only=True):
    """The answer to request `id`: a status, or an error (exactly one is set)."""
    id: int
    status: NodeStatus | None = None
    error: ErrorReply | None = None


class Status(msgspec.Struct, tag="status", tag_field="t", kw_only=True, gc=False):
    """The node's view changed (sent once right after `subscribe`, then on every change)."""
    status: NodeStatus


class Error(msgspec.Struct, tag="error", tag_field="t", kw_only=True):
    """Why the server closes the stream; `leader`: where to go instead (on `not_leader`)."""
    code: str
    message: str
    leader: str = ""


ClientFrame = Hello | Request | Subscribe | Heartbeat
ServerFrame = Reply | Status | Error

_client_decoder = msgspec.msgpack.Decoder(ClientFrame)
_server_decoder = msgspec.msgpack.Decoder(ServerFrame)
_encoder = msgspec.msgpack.Encoder()


class FrameError(Exception):
    """A frame that cannot be accepted: the stream is closed with `code` and this message."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def encode_frame(frame: Any) -> bytes:
    return _encoder.encode(frame)


def decode_client_frame(data: bytes) -> Hello | Request | Subscribe | Heartbeat:
    if len(data) > MAX_FRAME_BYTES:
        raise FrameError(ErrorCode.TOO_LARGE, f"frame of {len(data)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        frame: Hello | Request | Subscribe | Heartbeat = _client_decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError, RecursionError) as exc:
        text = str(exc) if not isinstance(exc, RecursionError) else "nested too deeply"
        raise FrameError(ErrorCode.BAD_REQUEST, f"bad frame: {text[:300]}") from None
    return frame


def decode_server_frame(data: bytes) -> Reply | Status | Error:
    frame: Reply | Status | Error = _server_decoder.decode(data)
    return frame
