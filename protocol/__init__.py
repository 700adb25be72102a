"""The wire between node agents and the rendezvous server: typed messages (msgspec structs) and the MessagePack
encoders and decoders for each direction. Plain data: nothing in this package does I/O."""
from protocol.codec import (
    REQUEST_TYPES,
    DecodeError,
    decode_reply,
    decode_request,
    encode,
)
from protocol.errors import HTTP_STATUS, ErrorCode
from protocol.messages import (
    PROTOCOL_VERSION,
    Assignment,
    ErrorReply,
    FailureReport,
    JobConfig,
    JobState,
    JoinRequest,
    LeaveRequest,
    NodeState,
    NodeStatus,
    PollRequest,
    SuccessReport,
    WorkerFailure,
)

__all__ = [
    "PROTOCOL_VERSION", "Assignment", "ErrorReply", "FailureReport", "JobConfig", "JoinRequest",
    "LeaveRequest", "NodeState", "JobState", "NodeStatus", "PollRequest", "SuccessReport", "WorkerFailure",
    "ErrorCode", "HTTP_STATUS", "DecodeError", "decode_reply", "decode_request", "encode", "REQUEST_TYPES",
]
