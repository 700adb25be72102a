"""What a server reply or refusal means for a node: the client's pure rules, shared by node-agent
(core/policy.py) and the torchrun plugin (plugin/session.py). No I/O.
For a node running round R (-1: none) a `NodeStatus` is one of `News`: the job ended (FINISHED: stop, exit);
not counted any more (REJOIN); a newer round with the node in it (NEW_ROUND: stop R, run it); R or older
(NONE: replies arrive out of order, so only a newer round is news); waiting, spare or excluded (NOT_MEMBER).
A typed refusal is one of `Refusal`, by code and request; a malformed one (INVALID: refused again whatever
it is) ends the node, which leaves the job so the others go on rather than wait."""
from __future__ import annotations

import enum

from protocol.errors import ErrorCode
from protocol.messages import Assignment, JoinRequest, NodeState, NodeStatus, PollRequest


class ClientCode(str, enum.Enum):
    """Refusals of the client's own, not the server's."""
    TLS_UNTRUSTED = "tls_untrusted"      # the server's TLS certificate is not trusted
    NOT_RDZV_SERVER = "not_rdzv_server"  # the endpoint answered, but it is not an rdzv-server
    UNKNOWN = "unknown"                  # a server's code this client does not know (a newer server)


Code = ErrorCode | ClientCode      # why a request was refused


def code_of(code: Code | str) -> Code:
    """A refusal's code, typed if the server sent it as text (ClientCode.UNKNOWN for one this client does not know)."""
    if isinstance(code, (ErrorCode, ClientCode)):
        return code
    for kind in (ErrorCode, ClientCode):
        try:
            return kind(code)
        except ValueError:
            pass
    return ClientCode.UNKNOWN


class Path(str, enum.Enum):
    """What a fresh connection to the server found (path_check.py), for the fencing rule (core/policy.py)."""
    REACHED = "reached"      # an endpoint answers ready: the path is back
    STANDBY = "standby"      # endpoints answer but none serves yet: a restart or replica takeover is under way
    NO_SERVER = "none"       # no endpoint answers at all


class News(enum.Enum):
    NONE = "none"
    NEW_ROUND = "new_round"
    NOT_MEMBER = "not_member"
    REJOIN = "rejoin"
    FINISHED = "finished"


def news(view: NodeStatus, running_round: int) -> News:
    """What `view` means for a node that runs `running_round` (-1: none)."""
    if view.job_state.finished:
        return News.FINISHED
    if view.node_state is NodeState.GONE:
        return News.REJOIN
    if view.node_state is NodeState.MEMBER and view.assignment is not None:
        return News.NEW_ROUND if view.assignment.round_id > running_round else News.NONE
    return News.NOT_MEMBER


def newer_assignment(view: NodeStatus, running_round: int) -> Assignment | None:
    """This node's assignment when `view` names a round newer than `running_round`."""
    return view.assignment if news(view, running_round) is News.NEW_ROUND else None


def takes_poll_reply(view: NodeStatus | None, reply: NodeStatus, sent_before_latest: bool) -> bool:
    """Whether a poll reply replaces the node's view: one sent before the latest answered request counts
    only when it shows progress (a newer round, the job's end)."""
    if view is None or not sent_before_latest:
        return True
    if view.job_state.finished:
        return False
    if reply.job_state.finished:
        return True
    return reply.node_state is NodeState.MEMBER and reply.round_id > view.round_id


class Refusal(enum.Enum):
    FORGOTTEN = "forgotten"        # the server has no record of the job or node (restarted without state): join again
    CONFLICT = "conflict"          # a join for a node id a live agent holds: maybe our own predecessor; retry a while
    TAKEN_OVER = "taken_over"      # another agent joined with this node id: this one must stop
    UNAUTHORIZED = "unauthorized"  # no valid token, or the server's certificate is not trusted: stop
    NOT_A_SERVER = "not_a_server"  # the endpoint answers, but it is not an rdzv-server: stop
    DRAINED = "drained"            # an operator took this node out: stop, and that is no failure
    RAN = "ran"                    # the run this node's previous agent worked in succeeded: nothing left, no failure
    JOIN_REFUSED = "join_refused"  # any other refused join: stop
    POLL_REFUSED = "poll_refused"  # any other refused poll: stop
    INVALID = "invalid"            # a request the server will refuse again (malformed, another version): leave, stop
    DROPPED = "dropped"            # a refused report: dropped; the next poll says where things stand


FORGOTTEN_CODES = (ErrorCode.UNKNOWN_JOB, ErrorCode.UNKNOWN_NODE)
INVALID_CODES = (ErrorCode.BAD_REQUEST, ErrorCode.UNSUPPORTED_VERSION, ErrorCode.TOO_LARGE)
# A join refused as CONFLICT (maybe our dead predecessor) is retried this often, for its lease and two tries more.
CONFLICT_RETRY_S = 1.0


def conflict_retry_for(lease_timeout_s: float) -> float:
    """How long a join refused as CONFLICT is tried again: until the predecessor's lease must have lapsed, and a
    server restarted on its saved state gives every node two leases more (JobRules.restored), so an agent restarted
    with its server (a host's reboot) outwaits that too rather than give up the node."""
    return 2 * lease_timeout_s + 2 * CONFLICT_RETRY_S


def refusal(code: Code, request: type) -> Refusal:
    """What a refusal with `code` of a `request` (a protocol request type) means for the node."""
    if code in (ErrorCode.UNAUTHORIZED, ClientCode.TLS_UNTRUSTED):
        return Refusal.UNAUTHORIZED
    if code is ClientCode.NOT_RDZV_SERVER:
        return Refusal.NOT_A_SERVER
    if code in INVALID_CODES and request is not JoinRequest:
        return Refusal.INVALID
    if request is JoinRequest:
        if code is ErrorCode.NODE_CONFLICT:
            return Refusal.CONFLICT
        if code is ErrorCode.NODE_DRAINED:
            return Refusal.DRAINED
        if code is ErrorCode.RUN_SUCCEEDED:
            return Refusal.RAN
        return Refusal.JOIN_REFUSED
    if code is ErrorCode.FORBIDDEN:
        return Refusal.TAKEN_OVER
    if request is not PollRequest:
        return Refusal.DROPPED
    if code in FORGOTTEN_CODES:
        return Refusal.FORGOTTEN
    return Refusal.POLL_REFUSED


# A refusal that ends the agent: its exit code, why its workers stop, and what it says ({}: the server's message).
_JOIN_REFUSED = (1, "the server refused this node's join", "the rendezvous server refused this node's join: {}")
ENDINGS: dict[Refusal, tuple[int, str, str]] = {
    Refusal.JOIN_REFUSED: _JOIN_REFUSED,
    Refusal.CONFLICT: _JOIN_REFUSED,          # once retried for its lease: a live agent holds the id
    Refusal.TAKEN_OVER: (1, "another agent took this node over", "this node was taken over by another agent that "
                                                                 "joined with the same node id; this agent stops ({})"),
    Refusal.UNAUTHORIZED: (1, "the server refused this agent", "the rendezvous server refused this agent: {}"),
    Refusal.NOT_A_SERVER: (1, "the endpoint is not an rdzv-server", "{}"),     # the message names what answered
    Refusal.DRAINED: (0, "node drained by the operator", "{}"),    # an operator took it out: done, nothing failed
    Refusal.RAN: (0, "the job already succeeded", "{}"),     # its workers ran in the run that succeeded
}
OTHER_ENDING = (1, "the server refused this agent", "the server refused this agent: {}")
