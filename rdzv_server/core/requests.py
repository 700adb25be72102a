"""The core's front door for agent requests: every kind goes through one pipeline (`Rendezvous.handle`), and only
then through its own rule here. The pipeline, once for every kind:
1. the job found (or, for a join, found, reused or created) and the server notes it heard an agent;
2. the node found: a kind that acts for a known node refuses an unknown one; a poll or a leave of a node the job
   no longer knows is answered as it stands;
3. the node's credential verified, then what the kind itself must check before anything changes (the ranks a
   report names): a refusal changes nothing and tells a forger nothing of the node;
4. the credential noted as proven and the lease renewed (held, for a poll the shell holds open);
5. the progress note the request carries taken (goodput, slow nodes), before the rule: the steps belong to the
   round the request saw, which the rule may end;
6. the kind's rule: it acts for that authenticated node and says why it did not act ("" when it did).
A new request kind is one protocol struct (protocol/codec.py names it) and one entry in KINDS, its rule with it."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from protocol.messages import (
    AgentRequest,
    FailureReport,
    JoinRequest,
    LeaveRequest,
    NodeStatus,
    PollRequest,
    StallReport,
    SuccessReport,
)
from rdzv_server.core import (
    admission,
    awaiting,
    credentials,
    floors,
    leases,
    progress_rules,
    reports,
    stops,
    store_port,
    suspects,
    swaps,
)
from rdzv_server.core.events import EventKind, RoundCause
from rdzv_server.core.job_rules import JobRules
from rdzv_server.core.payloads import NodeUnhealthy, RoundWaiting
from rdzv_server.core.progress_rules import LiveRound
from rdzv_server.core.records import NodeRecord
from rdzv_server.core.unhealthy import UnhealthyHosts


@dataclass(frozen=True)
class Arrival:
    """What the shell knows of a request besides its body."""
    peer: str = ""        # the agent's address, as the server saw it
    local: str = ""       # the server's address it reached
    secret: str = ""      # a fresh credential: kept only if a join makes a new node record
    hold: bool = False    # a poll the shell holds open until news (its connection is the lease meanwhile)
    # The server's own last outage its shell saw (its loop stalled, or its held connections heard nothing for
    # QUIET_S): (start, end). Members may have died unheard in it (leases.doubted).
    outage: tuple[float, float] | None = None


ARRIVED = Arrival()


@dataclass
class Call:
    """One authenticated request, as its rule sees it."""
    rules: JobRules
    node: NodeRecord | None        # None: a poll or leave of a node the job does not know (or any join)
    now: float
    arrival: Arrival
    live: LiveRound
    unhealthy: UnhealthyHosts
    credential: str = ""                 # a join's: the secret of the node record it made ("" if none)


@dataclass(frozen=True)
class Kind:
    """A kind's rule (step 6: it acts for the authenticated node; why it did not act, "" when it did) and what the
    pipeline does for the kind besides it."""
    rule: Callable[[Call, Any], str]
    known_node: bool = True                               # refused for a node the job does not know
    check: Callable[[JobRules, NodeRecord, Any], None] | None = None   # refusals before anything changes
    renews: bool = True                                   # traffic from the node (not a leave; a join: admission)
    authenticated: bool = True                            # False: the rule checks who it is (a join)
    reply: Callable[[Call, NodeStatus], None] | None = None   # what the kind adds to its reply


def authenticate(kind: Kind, rules: JobRules, req: AgentRequest, now: float, hold: bool) -> NodeRecord | None:
    """Steps 2 to 4 of the pipeline; the node the request acts for (None: unknown to the job, and allowed)."""
    if not kind.authenticated:
        return None
    node = rules.node(req.node_id) if kind.known_node else rules.job.nodes.get(req.node_id)
    if node is None:
        return None
    credentials.verify(node, req.credential)         # first: a forger learns nothing of the node
    if kind.check is not None:
        kind.check(rules, node, req)
    credentials.proven(node)
    if kind.renews:
        (leases.hold if hold else leases.renew)(rules.job, node, now)
        if reports.waited_for(rules.job, node):    # (a leave is not heard: a failure held for it stays held)
            reports.heard(rules, node, now)
    return node


def note_progress(call: Call, req: AgentRequest) -> None:
    """Step 5: the request's progress note, from an authenticated member."""
    note = getattr(req, "progress", None)
    if note is not None and call.node is not None:
        progress_rules.noted(call.rules, call.live, call.node.node_id, note, call.now)


# ---- the rules, one per kind ---------------------------------------------------------------------------------

def failure(call: Call, req: FailureReport) -> str:
    return reports.failure(call.rules, _member(call), req, call.now, call.arrival.outage)


def success(call: Call, req: SuccessReport) -> str:
    return reports.success(call.rules, _member(call), req, call.now)


def stall(call: Call, req: StallReport) -> str:
    return progress_rules.stalled(call.rules, call.live, _member(call), req, call.now)


def _member(call: Call) -> NodeRecord:
    assert call.node is not None        # a kind for known nodes only: the pipeline refused an unknown one
    return call.node


def join(call: Call, req: JoinRequest) -> str:
    call.credential = admission.join(call.rules, req, call.now, call.arrival.secret,
                                     (call.arrival.peer, call.arrival.local))
    return ""


def poll(call: Call, req: PollRequest) -> str:
    node = call.node
    if node is not None:
        if req.master_port:          # a port for its next round as master; saved with that round, not on its own
            if store_port.given(call.rules.job.round, node, req.master_port):
                call.rules.wake()                        # the round that waited for it: assignments for all
        if node.checks_due and req.checks_passed:
            suspects.passed(call.rules, node, call.now)
        was_ready = node.ready
        call.rules.readiness(node, req.ready and not node.checks_due, call.now)
        if node.ready and not was_ready and req.copies is None:
            # a drain's swap may wait for this spare (swaps.check), whose poll notes no copies before its first
            # round: else the ranks held until a member's next poll (a review)
            swaps.check(call.rules, call.now)
        if req.copies is not None:
            before = node.copies
            if (before is None or before.local_step < 0) != (req.copies.local_step < 0):
                call.rules.node_changed(node.node_id)     # saved: whether it holds state of its own (awaiting.py)
            floors.noted(call.rules.job, node, before, req.copies, call.now)
            swaps.check(call.rules, call.now)       # the copy a swap waits for may be on its peer now
    return ""


def leave(call: Call, req: LeaveRequest) -> str:
    rules, node, now = call.rules, call.node, call.now
    if rules.job.state.finished:
        return ""
    if req.stop_ended:        # its record went with its first leave: proven by what its stop kept (stops.py)
        if node is not None or not (said := stops.ended(rules.job, req.node_id, req.credential, now)):
            return "no stop of this node's moves the wait"
        rules.record(now, EventKind.ROUND_ABANDONED, said, req.node_id,     # (the wait's reason changed)
                     data=RoundWaiting(cause=RoundCause.NODE_LEFT.value))
        rules.changed()
        rules.out.deadline(rules.job.last_call_deadline or now)
        return ""
    unhealthy = None if req.unhealthy is None else NodeUnhealthy(kind=req.unhealthy.value,
                                                                 host=node.host if node is not None else "")
    if node is not None:     # unhealthy: as a lost node (no restart counted, a spare or a smaller world takes over)
        kind = EventKind.NODE_LEFT if unhealthy is None else EventKind.NODE_UNHEALTHY
        # an agent stopped from outside may be started again at once (systemctl restart): awaited as a restart, and
        # a restart is a loss to flap damping (stopped again and again: a flapping host, not awaited)
        restarting = req.stopped and unhealthy is None and awaiting.holds_own_state(rules.job, node)
        if restarting:
            leases.note_loss(rules.job, node.node_id, now)
        r = rules.job.round
        if unhealthy is None and r is not None and node.node_id in r.members:
            rules.job.writes_end_round = r.round_id     # no failure ends it: the others' writes under way may end
        rules.remove(node, now, kind, f"node {node.node_id} left: {req.reason}", data=unhealthy,
                     restarting=restarting, stopping_s=req.stop_timeout_s if restarting else 0.0)
        if req.unhealthy is not None:      # its host is kept out of every job for a while
            call.unhealthy.hold(node.host or node.addr, req.unhealthy.value, req.reason, rules.job.job_id,
                                req.node_id, now, source=node.seen_from)
    elif unhealthy is not None:
        # a node whose own check failed before it joined: the history says why it is missing
        rules.record(now, EventKind.NODE_UNHEALTHY, f"node {req.node_id} did not join: {req.reason}", req.node_id,
                     data=unhealthy)
    return ""


def _credential_reply(call: Call, status: NodeStatus) -> None:
    status.credential = call.credential      # only a newly made record's: a secret is told once


def _stall_reply(call: Call, status: NodeStatus) -> None:
    shown = progress_rules.shown_stall(call.rules.job, call.now)
    status.stall = shown.line(call.now) if shown is not None else ""


KINDS: dict[type, Kind] = {
    JoinRequest: Kind(join, known_node=False, renews=False, authenticated=False, reply=_credential_reply),
    PollRequest: Kind(poll, known_node=False),
    LeaveRequest: Kind(leave, known_node=False, renews=False),
    FailureReport: Kind(failure, check=reports.check_failure),
    SuccessReport: Kind(success),
    StallReport: Kind(stall, check=progress_rules.check_ranks, reply=_stall_reply),
}
