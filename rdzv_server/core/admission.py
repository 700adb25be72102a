"""Admission: who may join a job, and what a join does to the node's record.

Refused before anything changes: another config or command, a drained node, or a node a live agent holds (lease
running or poll held) without its credential. The owner may join again (without the secret while no request has
used it: the reply carrying it was lost); a new agent of a node whose agent is gone replaces it, keeping its
failure history and exclusion.
"""
from __future__ import annotations

from protocol.errors import ErrorCode
from protocol.messages import JoinRequest, NodeState
from protocol.quoting import quote
from rdzv_server.core import awaiting, credentials, gone_nodes, leases, places
from rdzv_server.core.addresses import same_host
from rdzv_server.core.errors import RendezvousError
from rdzv_server.core.events import EventKind
from rdzv_server.core.job_rules import JobRules
from rdzv_server.core.records import NodeRecord
from rdzv_server.core.rounds import PREPARE_LIMIT_S


def check_join(rules: JobRules, req: JoinRequest) -> None:
    """Refuse a join to this (open) job before anything changes."""
    job = rules.job
    diffs = (job.join_config or job.config).differences(req.config)
    if diffs:
        raise RendezvousError(ErrorCode.CONFIG_CONFLICT,
                              f"job {job.job_id!r} exists with another config: " + "; ".join(diffs) +
                              " (a job keeps its first join's settings: start this node with the job's, or give a "
                              "new run its own --rdzv-id)")
    if job.command and req.command and req.command != job.command:
        raise RendezvousError(ErrorCode.CONFIG_CONFLICT, f"job {job.job_id!r} runs another command (fingerprint "
                              f"{quote(job.command)}, this node's {quote(req.command)}): give this run its own "
                              "--rdzv-id, or --no-command-check on every node if their scripts or arguments differ "
                              "on purpose")
    if job.launcher and req.launcher and req.launcher != job.launcher:
        names = {"node-agent": "node-agent", "torchrun": "torchrun with the rdzv-server plugin"}
        raise RendezvousError(ErrorCode.CONFIG_CONFLICT, f"job {job.job_id!r} runs its workers under "
                              f"{names[job.launcher]}, this node under {names[req.launcher]}: one job runs one "
                              "launcher (their rounds' stores differ); start every node the same way, or give this "
                              "run its own --rdzv-id")
    if req.node_id in job.drained:
        raise RendezvousError(ErrorCode.NODE_DRAINED, f"node {req.node_id} was drained from job "
                              f"{job.job_id!r} by the operator ({job.drained[req.node_id]})")


def join(rules: JobRules, req: JoinRequest, now: float, credential: str, via: tuple[str, str]) -> str:
    """Admit the node (again); returns the credential of a newly made record ("" otherwise).
    `via`: (the join's source address, the server's address it reached), as the shell saw them."""
    check_join(rules, req)
    made = _admitted(rules, req, now, credential, via)
    job = rules.job
    if req.command and not job.command:     # the first node admitted that names its command sets the job's
        job.command = req.command
        rules.changed()
    if req.launcher and not job.launcher:   # and its launcher
        job.launcher = req.launcher
        rules.changed()
    return made


def _admitted(rules: JobRules, req: JoinRequest, now: float, credential: str, via: tuple[str, str]) -> str:
    job = rules.job
    existing = job.nodes.get(req.node_id)
    if existing is not None and credentials.owns(existing, req.credential, req.instance):
        _rejoined(rules, existing, req, via, now)
        return ""
    if (existing is not None and existing.credential_digest and not existing.credential_used and req.instance
            and req.instance == existing.instance):
        # The record's own agent (instance) joins without the secret no request has carried: the reply with it was
        # lost (a restart or takeover), so a fresh one replaces it. Once a request carried it, such a join is a stale
        # duplicate (a late request of an abandoned connection) that must not take the node: the rules below answer.
        existing.credential_digest = credentials.digest(credential)
        existing.credential_used = False
        rules.node_changed(existing.node_id)
        leases.renew(job, existing, now)
        return credential
    # A record that looks alive (not heard from since the server came back: every lease runs anew; or its agent's
    # end not noticed yet) whose agent's next instance proves it succeeds it (the old secret, from the node's
    # memory): the new one takes the place now (awaited: awaiting.py), as after a loss. Without the proof, a
    # token holder could take any node unheard after an outage, and its agent would stop (a review: step 0).
    successor = existing is not None and credentials.succeeds(existing, req.predecessor, req.instance) and \
        (existing.unheard or bool(existing.credential_digest))
    if existing is not None and existing.credential_digest and leases.live(existing, now) and not successor:
        raise RendezvousError(ErrorCode.NODE_CONFLICT, f"node id {req.node_id!r} is held by a live agent of "
                              f"job {job.job_id!r} (heard from {now - existing.last_seen:.1f}s ago, at "
                              f"{existing.addr}); give this agent another node id, or wait until that "
                              f"agent is gone ({max(0.0, existing.lease_expires - now):.1f}s without contact)")
    # an exclusion its previous agent's record had runs on (_new_record): said as such, not as the restart's hold
    carried = existing is not None and existing.excluded_until > now and not existing.held_off
    if existing is not None:
        leases.note_loss(job, existing.node_id, now, restarted=True)   # a loss as a lease run out (flap damping)
        rules.remove(existing, now, EventKind.NODE_LOST, f"node {req.node_id} restarted (new agent instance)",
                     failed_at=existing.last_seen, restarting=awaiting.holds_own_state(job, existing))
    node = _new_record(rules, req, now, credential, via, existing)
    # an exclusion its gone record left (gone_nodes.py) runs on: said as such, not as a restart's
    kept = gone_nodes.take_up(job, node, now, fresh=existing is None)
    _place(rules, node, now, "the rest of its exclusion, kept while it had no agent; an operator's clear-exclusion "
           "readmits it" if kept else "the rest of its exclusion, which its agent's restart does not end; an "
           "operator's clear-exclusion readmits it" if carried else "its agent restarted")
    return credential


def _rejoined(rules: JobRules, node: NodeRecord, req: JoinRequest, via: tuple[str, str], now: float) -> None:
    """The node's own agent joined again (a retry, or after the server restarted): refresh what changed."""
    port = req.master_port or node.master_port
    if (node.addr, node.master_port, node.seen_from, node.server_addr, node.witness_port, node.copy_port) != \
            (req.addr, port, *via, req.witness_port, req.copy_port):
        node.addr, node.master_port, node.witness_port, node.copy_port = req.addr, port, req.witness_port, req.copy_port
        node.seen_from, node.server_addr = via
        rules.node_changed(node.node_id)
    node.credential_used = node.credential_used or bool(node.credential_digest)
    leases.renew(rules.job, node, now)
    rules.readiness(node, req.ready and not node.checks_due, now)


def _new_record(rules: JobRules, req: JoinRequest, now: float, credential: str, via: tuple[str, str],
                previous: NodeRecord | None) -> NodeRecord:
    """A new record with its secret's digest, keeping a previous record's failures and exclusion (cooldowns run on)."""
    job = rules.job
    node = NodeRecord(node_id=req.node_id, instance=req.instance, addr=req.addr, host=req.host or req.addr,
                      role=req.role, local_world_size=req.local_world_size, master_port=req.master_port,
                      state=NodeState.GONE, joined_at=now, last_seen=now,
                      lease_expires=now + job.config.lease_timeout_s,
                      credential_digest=credentials.digest(credential), seen_from=via[0], server_addr=via[1],
                      witness_port=req.witness_port, checks=req.checks, ready=req.ready,
                      preparing_since=0.0 if req.ready else now, domain=req.domain, copy_port=req.copy_port,
                      store_per_round=req.store_per_round, copy_verifiers=req.copy_verifiers)
    rules.out.deadline(node.lease_expires)
    if not req.ready:
        rules.out.deadline(now + PREPARE_LIMIT_S)
    if previous is not None:
        node.failure_times, node.exclusions = list(previous.failure_times), previous.exclusions
        node.excluded_until, node.held_off = previous.excluded_until, previous.held_off
    job.nodes[node.node_id] = node
    rules.node_changed(node.node_id)
    seen = f" (connected from {node.seen_from})" if node.seen_from and not same_host(node.seen_from, node.addr) \
        else ""
    rules.record(now, EventKind.NODE_JOINED, f"node {node.node_id} joined from {node.addr}{seen} "
                 f"with {node.local_world_size} workers", node.node_id)     # addr: what it says; seen: TCP's
    return node


def _place(rules: JobRules, node: NodeRecord, now: float, why: str) -> None:
    """Admit a new node, or keep it out while its exclusion (or a flapping host's hold-off) lasts (`why`)."""
    job, cfg = rules.job, rules.job.config
    losses = leases.recent_losses(job, node.node_id, now)
    if cfg.exclude_lost_after and losses >= cfg.exclude_lost_after and node.node_id not in job.awaited:
        # (one the job waits for passed awaiting.flapping's stricter count: held off, it would only cost the wait)
        # A host that keeps dropping out would cost every other node a round each way: kept out, where the job can
        # run without it (a spare, or more than its minimum); else keeping it out would only stop the job.
        others = [n for n in job.nodes.values() if n.node_id != node.node_id and n.excluded_until <= now
                  and leases.live(n, now)]
        hold = min(cfg.exclude_lost_cooldown_s * 2 ** (losses - cfg.exclude_lost_after), cfg.exclude_cooldown_max_s)
        if len(others) < cfg.min_nodes:
            if node.held_off:                # a hold-off of an earlier return ends too
                node.excluded_until, node.held_off = min(node.excluded_until, now), False
            rules.record(now, EventKind.NODE_JOINED, f"node {node.node_id} was lost {losses} times within "
                         f"{cfg.exclude_window_s:g}s, but is not excluded: the job needs {cfg.min_nodes} nodes and "
                         f"has {len(others)} without it", node.node_id)
        elif now + hold > node.excluded_until:
            node.excluded_until, node.held_off = now + hold, True
            why = f"it was lost {losses} times within {cfg.exclude_window_s:g}s: a flapping host"
    if node.excluded_until > now:
        places.move(job, node, NodeState.EXCLUDED)
        rules.out.deadline(node.excluded_until)
        rules.record(now, EventKind.NODE_EXCLUDED, f"node {node.node_id} excluded for "
                     f"{round(node.excluded_until - now, 1):g}s ({why})", node.node_id)
    else:
        rules.admit(node, now)
