"""Error codes carried in `ErrorReply.code`, and the HTTP status each one maps to."""
from __future__ import annotations

import enum

from protocol.quoting import quote


class ErrorCode(str, enum.Enum):
    BAD_REQUEST = "bad_request"              # body is not valid MessagePack or a field has the wrong type/value
    UNSUPPORTED_VERSION = "unsupported_version"  # request's `v` is not one this server speaks
    TOO_LARGE = "too_large"                  # body over the server's size limit
    NOT_FOUND = "not_found"                  # unknown route
    METHOD_NOT_ALLOWED = "method_not_allowed"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    UNKNOWN_JOB = "unknown_job"              # job id never joined (or forgotten)
    UNKNOWN_NODE = "unknown_node"            # node id is not part of this job (rejoin)
    CONFIG_CONFLICT = "config_conflict"      # join asked for a config that differs from the job's
    NODE_CONFLICT = "node_conflict"          # node id in use by another live agent
    JOB_FINISHED = "job_finished"            # job succeeded/failed/closed: no new joins
    RUN_SUCCEEDED = "run_succeeded"          # the next agent of a member of a run that succeeded: nothing to run
    NODE_DRAINED = "node_drained"            # an operator removed this node from the job: do not rejoin
    HOST_UNHEALTHY = "host_unhealthy"        # the host left a job unhealthy: kept out until the hold ends
    UNAUTHORIZED = "unauthorized"            # no or wrong token, or no credential for this node
    FORBIDDEN = "forbidden"                  # not allowed: a foreign origin or host, a credential of another agent
    LIMIT_REACHED = "limit_reached"          # a server limit (jobs, long-polls per peer, ...): retry later
    SHUTTING_DOWN = "shutting_down"          # server is going away; retry elsewhere/later
    STORE_UNAVAILABLE = "store_unavailable"  # the state store could not commit; retry shortly
    NOT_LEADER = "not_leader"                # a standby replica: the Rdzv-Leader header says where the leader is
    INTERNAL = "internal"                    # a bug: reported without a traceback


HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.BAD_REQUEST: 400,
    ErrorCode.UNSUPPORTED_VERSION: 400,
    ErrorCode.TOO_LARGE: 413,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.METHOD_NOT_ALLOWED: 405,
    ErrorCode.UNSUPPORTED_MEDIA_TYPE: 415,
    ErrorCode.UNKNOWN_JOB: 404,
    ErrorCode.UNKNOWN_NODE: 404,
    ErrorCode.CONFIG_CONFLICT: 409,
    ErrorCode.NODE_CONFLICT: 409,
    ErrorCode.JOB_FINISHED: 410,
    ErrorCode.RUN_SUCCEEDED: 410,
    ErrorCode.NODE_DRAINED: 410,
    ErrorCode.HOST_UNHEALTHY: 409,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.LIMIT_REACHED: 503,
    ErrorCode.SHUTTING_DOWN: 503,
    ErrorCode.STORE_UNAVAILABLE: 503,
    ErrorCode.NOT_LEADER: 503,
    ErrorCode.INTERNAL: 500,
}

# Errors that say "not now" rather than "no": an agent keeps its workers and retries, as for an outage.
RETRYABLE: frozenset[ErrorCode] = frozenset({ErrorCode.SHUTTING_DOWN, ErrorCode.STORE_UNAVAILABLE,
                                             ErrorCode.LIMIT_REACHED, ErrorCode.NOT_LEADER})


def unknown_job(job_id: str) -> str:
    """The one wording of "no such job", wherever a job id is looked up."""
    return f"no job {quote(job_id)} on this server"
