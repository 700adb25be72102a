"""Leases: when the server may conclude that a node is gone, and when it must not.

A node's lease says the server has reason to think it alive:
- every request from the node renews it: the lease then runs `lease_timeout_s` from that request;
- while a long-poll of the node is held open the lease does not run at all: the open connection
  is the lease (TCP keepalive on the server's sockets ends a connection whose host died or was cut
  off, which counts as the connection closing);
- when a held poll's connection closes under it, the node has DROP_GRACE_S (capped by its lease)
  to come back: a dying agent's connection is the fastest evidence there is.

Evidence must be about the node, never about the server itself:
- "heard" is any sign that the server's link works: a request, a stream's heartbeat, and, once the
  server has heard nothing else for SUSPECT_QUIET_S, the freshest ACK on the held polls' connections
  (their kernels answer keepalive probes: in a small job every long hold is otherwise a silence;
  rdzv_server/delivery/links.py);
- when the server heard from no agent at all for QUIET_S (longer than any healthy node waits
  between requests), it is the server that was cut off or stalled: leases that lapse then are
  extended instead, and nobody is lost, until the silence has lasted OUTAGE_LIMIT_S (the agents'
  default --server-wait), after which it means what it says;
- a lease that runs out after the server has heard from nobody for SUSPECT_QUIET_S waits: the
  server's own link may have just gone, and a held poll's last sign of life can predate that by a
  keepalive period, so such a lease could otherwise run out before the quiet rule sees the outage;
  it is judged again once someone is heard (then it lapses) or by the quiet rule. Neither rule holds
  a node whose connection its host closed (a FIN or RST just in), or that closed before the silence
  or as it began (`closing_heard`): that is evidence about the node (a 2-node job lost a dead node a
  whole lease late, or never);
- a silence that ended (the server hears someone again after SUSPECT_QUIET_S or more of nobody) may
  have been the server's own link, blocking every node: a node heard within LEAD_S before it began
  (a healthy node's last sign of life, a keepalive ACK included, is at most about that old) and not
  since had no chance to come back while it lasted, and the others come back first by chance. Its
  lease, if it runs out before the silence's end + RESUME_GRACE_S (the time an agent needs to find
  the path back over a fresh connection, node_agent/client/path_check.py), runs until then; a held
  poll's connection that closed during the silence (its keepalive gave up) likewise. While the job's
  nodes keep coming back (`ReturnWave`: thousands of them take the server seconds to take back), that
  grace runs from the last one back instead, so a node that really died is lost RESUME_GRACE_S after
  the others have returned;
- a lease does not lapse while the server runs `lag_s` behind (its event loop late, requests
  waiting in its own backlog); it is judged again once the server has caught up. A connection that
  closed waits too: an agent closes a poll whose answer is overdue and sends it again on a new one,
  which may be in that backlog (so a dead agent is found up to the lag later, at most a lease).
Several nodes lapsing at once leave together, so one round forms without any of them.
"""
from __future__ import annotations

from dataclasses import dataclass

from rdzv_server.core.outbox import Outbox
from rdzv_server.core.records import JobRecord, NodeRecord

DROP_GRACE_S = 1.0
QUIET_S = 4.0
SUSPECT_QUIET_S = 1.5   # silence from everyone past this: a lapsing lease waits (judged again once someone is heard)
OUTAGE_LIMIT_S = 60.0
LEAD_S = 2.0            # a node heard this long before a silence began may have been cut off by it
RESUME_GRACE_S = 1.5    # after a silence ends, the time a cut-off agent needs to come back (path_check.py:
                        # a check within about 0.65 s, then the request)
@dataclass(frozen=True)
class Hearing:
    """What the server has heard lately, by which one job's lapsing leases are judged at a tick (built
    by Rendezvous.tick for each job)."""
    lag_s: float = 0.0                           # how far behind the server's own loop runs
    quiet_s: float | None = None                 # heard from no agent this long: its own fault (QUIET_S..)
    suspect_s: float = 0.0                       # a shorter silence (SUSPECT_QUIET_S..): lapsing leases wait
    silence: tuple[float, float] | None = None   # the last such silence that ended (grace_after_silence)
    wave: ReturnWave | None = None               # the job's nodes coming back since it ended
    say_quiet: bool = True                       # the quiet rule's extension not yet told in the job's events


HEARD = Hearing()            # a server that runs on time and hears its agents


MAX_LOSS_HISTORY = 1000      # nodes whose losses a job remembers
MAX_LOSSES_KEPT = 32         # losses remembered per node


def renew(job: JobRecord, node: NodeRecord, now: float) -> None:
    """Traffic from the node: its lease runs from now (later only: no deadline comes closer)."""
    node.last_seen = now
    node.dropped = False
    node.lease_expires = now + job.config.lease_timeout_s


def hold(job: JobRecord, node: NodeRecord, now: float) -> None:
    """A long-poll of the node is now held open: its lease stops running."""
    renew(job, node, now)
    node.holding += 1


def release(job: JobRecord, node: NodeRecord, now: float, out: Outbox, heard_at: float | None = None) -> None:
    """A held long-poll was answered: the lease runs again, from the last evidence that the node was
    alive (`heard_at`: its connection's last ACK, a keepalive probe's answer included), not from the
    answer itself, which says nothing about the node: a host cut off during the hold is still found
    within a lease of the cut."""
    node.holding = max(0, node.holding - 1)
    renew(job, node, max(node.last_seen, min(now, heard_at if heard_at is not None else now)))
    if node.holding == 0:
        out.deadline(node.lease_expires)


def drop(job: JobRecord, node: NodeRecord, now: float, out: Outbox, heard: bool = False) -> None:
    """A held long-poll's connection closed under it: a short grace to come back, from now. (Not
    capped by the expiry the hold began with: the open poll was the lease until now, and a poll held
    20 s at 10,000 nodes, closed by its agent to send it again, was lost at once.)"""
    node.holding = max(0, node.holding - 1)
    node.dropped, node.dropped_at, node.drop_heard = True, now, heard
    node.lease_expires = now + min(DROP_GRACE_S, job.config.lease_timeout_s)
    out.deadline(node.lease_expires)


def running(node: NodeRecord) -> bool:
    """Whether the node's lease is running (no poll of it held open)."""
    return node.holding == 0


def live(node: NodeRecord, now: float) -> bool:
    """Whether the node may still be alive: a poll held open, or a lease not yet lapsed."""
    return node.holding > 0 or (not node.dropped and node.lease_expires > now)


def closing_heard(node: NodeRecord, began: float) -> bool:
    """Whether the node's connection closed by its host (a FIN or RST came in), or before the silence
    that `began` then, or as it began: evidence about the node, rather than a close the silence itself
    may have caused (a keepalive giving up in it)."""
    return node.dropped and (node.drop_heard or node.dropped_at < began + SUSPECT_QUIET_S)


def patience_s(node: NodeRecord, now: float, lag_s: float, quiet_s: float) -> float:
    """How long past its lease a node waits before it is judged: the server's lag, and a silence of
    `quiet_s` (SUSPECT_QUIET_S or more) unless its closing was heard before the silence."""
    return lag_s if quiet_s <= 0 or closing_heard(node, now - quiet_s) else max(lag_s, quiet_s)


def lapsed(job: JobRecord, now: float, lag_s: float, quiet_s: float = 0.0) -> tuple[list[NodeRecord], list[NodeRecord]]:
    """(nodes whose lease has lapsed, nodes whose lease would have but the server runs `lag_s` behind or
    heard nobody for `quiet_s`, SUSPECT_QUIET_S or more: its own link may have just gone)."""
    gone: list[NodeRecord] = []
    deferred: list[NodeRecord] = []
    for node in job.nodes.values():
        if node.holding == 0 and node.lease_expires <= now:
            # A closed connection waits for a server behind too (its node may have sent its request
            # again on a new one, waiting in the server's own backlog).
            wait = patience_s(node, now, lag_s, quiet_s)
            (gone if node.lease_expires + wait <= now else deferred).append(node)
    return gone, deferred


@dataclass
class ReturnWave:
    """A job's nodes coming back after a silence ended: how many are back, when that last grew, and
    whether the grace has run out (then nothing is left to do for this silence: no scan per tick)."""
    back: int = -1
    grew_at: float = 0.0
    over: bool = False


def grace_after_silence(job: JobRecord, silence: tuple[float, float] | None, now: float, out: Outbox,
                        wave: ReturnWave | None = None) -> None:
    """Leases running out now that the last silence (`silence`: (began, ended), the server's own time
    with nobody heard) may explain run until RESUME_GRACE_S after its end, or after the last of the
    job's nodes came back while they still come back (`wave`, kept by the caller per silence)."""
    if silence is None:
        return
    began, ended = silence
    until = ended + RESUME_GRACE_S
    if wave is not None:
        if wave.over:
            return
        back = sum(1 for node in job.nodes.values() if node.last_seen >= ended)
        if wave.back < 0:               # first seen: those back came back as the silence ended
            wave.back, wave.grew_at = back, ended
        elif back > wave.back:
            wave.back, wave.grew_at = back, now
        until = max(ended, wave.grew_at) + RESUME_GRACE_S
        if now >= until:                # a lease given until then would have lapsed already
            wave.over = True
            return
    for node in job.nodes.values():
        if node.holding or node.lease_expires > now or node.lease_expires >= until or node.last_seen >= ended:
            continue
        # a held poll's connection closed by its keepalive: late in the silence, not at its start
        cut_in_silence = (not closing_heard(node, began) and node.dropped_at < ended if node.dropped
                          else node.last_seen > began - LEAD_S)
        if cut_in_silence:
            node.dropped = False
            node.lease_expires = until
            out.deadline(until)


def extend(job: JobRecord, nodes: list[NodeRecord], now: float, by: float, out: Outbox) -> None:
    """Give `nodes` `by` seconds more (the server was cut off or behind: not their fault). A node whose
    connection closed stays so: if it does not come back, that is why it was lost."""
    for node in nodes:
        node.lease_expires = now + by
    out.deadline(now + by)


def hold_back(job: JobRecord, nodes: list[NodeRecord], now: float, lag_s: float, quiet_s: float,
              out: Outbox) -> None:
    """Judge `nodes` (`lapsed`'s deferred) again once each one's patience has passed, a lease at most."""
    for node in nodes:
        by = min(patience_s(node, now, lag_s, quiet_s), job.config.lease_timeout_s)
        node.lease_expires = now + by
        out.deadline(now + by)


def note_loss(job: JobRecord, node_id: str, now: float) -> None:
    """Remember when a node was lost (its record is gone): a host that keeps dropping out is kept
    out when it comes back (admission.py), so it cannot cost every other node a round each way."""
    window = job.config.exclude_window_s
    history = job.loss_times
    history[node_id] = [t for t in history.get(node_id, []) if t > now - window][-MAX_LOSSES_KEPT:] + [now]
    if len(history) > MAX_LOSS_HISTORY:          # bounded: the nodes lost longest ago are forgotten
        for old in sorted(history, key=lambda n: history[n][-1])[: len(history) - MAX_LOSS_HISTORY]:
            del history[old]


def recent_losses(job: JobRecord, node_id: str, now: float) -> int:
    return sum(t > now - job.config.exclude_window_s for t in job.loss_times.get(node_id, []))


def why_lapsed(job: JobRecord, node: NodeRecord, now: float) -> str:
    if node.dropped:
        return "its connection closed"
    return f"no contact for {now - node.last_seen:.1f}s (lease {job.config.lease_timeout_s:g}s)"
