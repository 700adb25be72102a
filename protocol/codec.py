"""One MessagePack encoder and one decoder per direction. A request body is the client's, so whatever a decoder
raises on it (msgspec's errors; on some versions a TypeError for an unhashable map key, a RecursionError for deep
nesting, a UnicodeDecodeError) is a DecodeError, never an exception the server did not expect."""
from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from protocol.errors import ErrorCode
from protocol.messages import (
    PROTOCOL_VERSION,
    AgentRequest,
    ErrorReply,
    FailureReport,
    JoinRequest,
    LeaveRequest,
    NodeStatus,
    PollRequest,
    StallReport,
    SuccessReport,
)
from protocol.quoting import quote

CONTENT_TYPE = "application/msgpack"
MAX_BODY_BYTES = 1 << 20

R = TypeVar("R", bound=AgentRequest)

REQUEST_TYPES: dict[str, type[AgentRequest]] = {
    "join": JoinRequest,
    "poll": PollRequest,
    "failure": FailureReport,
    "success": SuccessReport,
    "leave": LeaveRequest,
    "stall": StallReport,
}


class DecodeError(Exception):
    """A body that cannot be accepted; `code` says which kind of wrong it is."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


encode = msgspec.msgpack.Encoder().encode
_request_decoders: dict[type, msgspec.msgpack.Decoder[Any]] = {
    cls: msgspec.msgpack.Decoder(cls) for cls in REQUEST_TYPES.values()}
_status_decoder = msgspec.msgpack.Decoder(NodeStatus)
_error_decoder = msgspec.msgpack.Decoder(ErrorReply)
_any_decoder = msgspec.msgpack.Decoder()


class _Versioned(msgspec.Struct):
    """A refused body's version alone, typed: the rest is skipped, never built. Built untyped, a body of 1 MiB was a
    million objects, ~70 MB and 0.2-0.3 s of the server's one loop a request (a review: a stranger's 11 a second lagged
    every agent's poll by up to 0.55 s; plain bytes at 600 a second, 0.04 s)."""
    v: int | float | str | bool | None = None


_version_decoder = msgspec.msgpack.Decoder(_Versioned)


def decode_request(cls: type[R], body: bytes) -> R:
    """Decode a request body into `cls`, or raise DecodeError naming what was wrong. The typed decode comes first
    (one pass for a good request); only a body it refuses is read again for its version alone (`_Versioned`), so
    that a client of another version hears `unsupported_version` rather than a confusing field error."""
    if len(body) > MAX_BODY_BYTES:
        raise DecodeError(ErrorCode.TOO_LARGE, f"body of {len(body)} bytes exceeds {MAX_BODY_BYTES}")
    try:
        req: R = _request_decoders[cls].decode(body)
    except Exception as exc:   # noqa: BLE001 - see the top: any error on a client's body is the client's
        _check_version(body)
        if isinstance(exc, msgspec.ValidationError):
            raise DecodeError(ErrorCode.BAD_REQUEST, _short(exc)) from None
        raise DecodeError(ErrorCode.BAD_REQUEST, f"body is not valid MessagePack: {_short(exc)}") from None
    if req.v != PROTOCOL_VERSION:      # every request type has `v`
        _check_version(body)
    return req


def _check_version(body: bytes) -> None:
    """Raise DecodeError when the body is not a map, has no `v`, or speaks another version."""
    try:
        version = _version_decoder.decode(body).v
    except msgspec.ValidationError as exc:
        raise DecodeError(ErrorCode.BAD_REQUEST, f"body must be a map of field names with a version `v`: "
                          f"{_short(exc)}") from None
    except Exception as exc:   # noqa: BLE001 - see the top
        raise DecodeError(ErrorCode.BAD_REQUEST, f"body is not valid MessagePack: {_short(exc)}") from None
    if version is None:
        raise DecodeError(ErrorCode.BAD_REQUEST, "Object missing required field `v` (protocol version)")
    if version != PROTOCOL_VERSION:   # `true` or `1.0` pass here: the typed decode names the field
        raise DecodeError(ErrorCode.UNSUPPORTED_VERSION,
                          f"protocol version {quote(version)} is not supported; this server speaks {PROTOCOL_VERSION}")


def _short(exc: Exception) -> str:
    """An error's text, bounded: it may quote what the client sent."""
    text = str(exc) if not isinstance(exc, RecursionError) else "nested too deeply"
    return text if len(text) <= 300 else text[:300] + "..."


def decode_reply(body: bytes) -> NodeStatus | ErrorReply:
    """Decode a server reply: a NodeStatus, or an ErrorReply (told apart by its `code` key)."""
    raw = _any_decoder.decode(body)
    if isinstance(raw, dict) and "code" in raw and "job_state" not in raw:
        return _error_decoder.decode(body)
    return _status_decoder.decode(body)
