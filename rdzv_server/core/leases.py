"""Leases: when the server may conclude that a node is gone, and when it must not.

- A request from the node renews its lease for `lease_timeout_s`. While a long-poll of it is held open the lease
  does not run (the connection is the lease: TCP keepalive ends one whose host died or was cut off); when a held
  poll's connection closes, the node has DROP_GRACE_S (capped by its lease) to come back.
Evidence must be about the node, never about the server itself:
- "Heard" is any sign the server's link works: a request, a held poll answered, and, after DOUBT_QUIET_S of
  nothing else, the freshest keepalive ACK on held polls' connections (rdzv_server/delivery/links.py).
- Heard from no agent for QUIET_S (longer than any healthy node waits between requests): the server was cut off
  or stalled, so lapsing leases are extended until the silence reaches OUTAGE_LIMIT_S (agents' --server-wait).
- A lease running out after DOUBT_QUIET_S of silence waits until someone is heard or the quiet rule takes it:
  the server's link may have just gone, and a held poll's last sign of life can predate that by a keepalive
  period. Not so a node whose host closed its connection, or whose connection closed before or as the silence
  began (`closing_heard`).
- A silence that ended may have been the server's own, blocking every node (the others came back first by
  chance): a node heard within LEAD_S before it (a healthy node's last sign of life is at most that old) and not
  since, or whose held poll's connection closed in it, keeps its lease until its end + RESUME_GRACE_S, or, while
  the job's nodes keep coming back (`ReturnWave`), the last return + RESUME_GRACE_S.
- No lease lapses while the server runs `lag_s` behind; closed connections wait too (the agent re-sends an overdue
  poll on a new one, maybe in the backlog), at most a lease.
- A held poll answered leaves its node `answered` until its next request: a failure of its peers waits for that
  (reports.fail_round), as its agent killed before it polls again closes no held poll.
Nodes lapsing at once leave together, so one round forms without any of them.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from rdzv_server.core.outbox import Outbox
from rdzv_server.core.records import JobRecord, NodeRecord

DROP_GRACE_S = 1.0
QUIET_S = 4.0
DOUBT_QUIET_S = 1.5     # silence from everyone past this: a lapsing lease waits until someone is heard
OUTAGE_LIMIT_S = 60.0
LEAD_S = 2.0            # a node heard this long before a silence began may have been cut off by it
RESUME_GRACE_S = 1.5    # after a silence ends, the time a cut-off agent needs to come back (path_check.py)
SETTLE_S = 2.0          # after an outage of the server's own, how long a failure report doubts the unheard


@dataclass(frozen=True)
class Hearing:
    """What the server heard lately, by which one job's lapsing leases are judged (Rendezvous.tick)."""
    lag_s: float = 0.0                           # how far behind the server's own loop runs
    quiet_s: float | None = None                 # heard from no agent this long: its own fault (QUIET_S..)
    doubt_s: float = 0.0                         # a shorter silence (DOUBT_QUIET_S..): lapsing leases wait
    silence: tuple[float, float] | None = None   # the last such silence that ended (grace_after_silence)
    wave: ReturnWave | None = None               # the job's nodes coming back since it ended
    say_quiet: bool = True                       # the quiet rule's extension not yet told in the job's events


MAX_LOSS_HISTORY = 1000      # nodes whose losses a job remembers
MAX_LOSSES_KEPT = 32         # losses remembered per node


def renew(job: JobRecord, node: NodeRecord, now: float) -> None:
    """Traffic from the node: its lease runs from now (later only: no deadline comes closer)."""
    node.last_seen = now
    node.dropped = node.answered = False
    node.lease_expires = now + job.config.lease_timeout_s


def doubted(job: JobRecord, members: Iterable[str], reporter: str, outage: tuple[float, float] | None,
            now: float) -> list[str]:
    """The members a failure reported as an outage of the server's own ends (its loop stalled, or its link cut:
    Arrival.outage) leaves in doubt: those not heard from since. Their peers' collectives break when one dies unheard
    in it (its FIN lost to the cut, or read after a stall; its new agent's join on its way), and its record looks
    alive for a lease; as after a server restart they are marked unheard, so the failure waits for them to be heard
    from (then counted) or lost (reports.fail_round). Doubted only within SETTLE_S: reports queued in it come first."""
    if outage is None or not 0.0 <= now - outage[1] <= SETTLE_S:
        return []
    out = []
    for nid in members:
        node = job.nodes.get(nid)
        if node is not None and nid != reporter and node.last_seen < outage[1]:
            node.unheard = True
            out.append(nid)
    return out


def hold(job: JobRecord, node: NodeRecord, now: float) -> None:
    """A long-poll of the node is now held open: its lease stops running."""
    renew(job, node, now)
    node.holding += 1


def release(job: JobRecord, node: NodeRecord, now: float, out: Outbox, heard_at: float | None = None) -> None:
    """A held long-poll was answered: the lease runs again from `heard_at` (its connection's last ACK), not from
    the answer, which says nothing about the node: a host cut off during the hold is found a lease after the cut."""
    node.holding = max(0, node.holding - 1)
    renew(job, node, max(node.last_seen, min(now, heard_at if heard_at is not None else now)))
    node.answered = node.holding == 0       # until its next request (a healthy agent's comes within ms)
    if node.holding == 0:
        out.deadline(node.lease_expires)


def drop(job: JobRecord, node: NodeRecord, now: float, out: Outbox, heard: bool = False) -> None:
    """A held long-poll's connection closed: a short grace from now (not from the hold's start: it was the lease)."""
    node.holding = max(0, node.holding - 1)
    node.dropped, node.dropped_at, node.drop_heard = True, now, heard
    node.lease_expires = now + min(DROP_GRACE_S, job.config.lease_timeout_s)
    out.deadline(node.lease_expires)


def hold_last_call(job: JobRecord, now: float, out: Outbox) -> bool:
    """At a last call's end, whether a ready newcomer's connection closed and its grace still runs: the window is held
    to the grace's end (at most DROP_GRACE_S), when it is back or lost. Formed at once, the round took in a killed
    agent and formed again without it a moment later: every running worker stopped twice, for nothing."""
    # Held once, for connections closed by the last call's own end: a node back and away again within each grace
    # (a flaky link, or an agent doing so on purpose) would hold it again at every hold's end, for ever (a review).
    # A hold's end comes within a grace of the last call's; a mark older than two graces is a stale one's.
    began = job.last_call_held if job.last_call_held and now - job.last_call_held <= 2 * DROP_GRACE_S else now
    ends = [n.lease_expires for nid in job.waiting if (n := job.nodes.get(nid)) is not None and n.ready and
            n.dropped and n.holding == 0 and n.lease_expires > now and n.dropped_at <= began]
    if not ends:
        job.last_call_held = 0.0
        return False
    job.last_call_deadline, job.last_call_held = max(ends), began
    out.deadline(job.last_call_deadline)
    return True


def live(node: NodeRecord, now: float) -> bool:
    """Whether the node may still be alive: a poll held open, or a lease not yet lapsed."""
    return node.holding > 0 or (not node.dropped and node.lease_expires > now)


def closing_heard(node: NodeRecord, began: float) -> bool:
    """Whether the node's connection was closed by its host (FIN or RST), or before or as the silence from `began`
    began: evidence about the node, not a close the silence may have caused (a keepalive giving up)."""
    return node.dropped and (node.drop_heard or node.dropped_at < began + DOUBT_QUIET_S)


def patience_s(node: NodeRecord, now: float, lag_s: float, quiet_s: float) -> float:
    """How long past its lease a node waits to be judged: the lag, and the silence `quiet_s` unless `closing_heard`."""
    return lag_s if quiet_s <= 0 or closing_heard(node, now - quiet_s) else max(lag_s, quiet_s)


def lapsed(job: JobRecord, now: float, lag_s: float, quiet_s: float = 0.0) -> tuple[list[NodeRecord], list[NodeRecord]]:
    """(nodes whose lease lapsed, nodes whose lease would have but the server runs `lag_s` behind or heard nobody
    for `quiet_s`: its own link may have just gone)."""
    gone: list[NodeRecord] = []
    deferred: list[NodeRecord] = []
    for node in job.nodes.values():
        if node.holding == 0 and node.lease_expires <= now:
            wait = patience_s(node, now, lag_s, quiet_s)
            (gone if node.lease_expires + wait <= now else deferred).append(node)
    return gone, deferred


@dataclass
class ReturnWave:
    """A job's nodes coming back after a silence: how many, when that last grew, whether the grace is over."""
    back: int = -1
    grew_at: float = 0.0
    over: bool = False


def grace_after_silence(job: JobRecord, silence: tuple[float, float] | None, now: float, out: Outbox,
                        wave: ReturnWave | None = None) -> None:
    """Leases running out that the last `silence` ((began, ended), nobody heard) may explain run until
    RESUME_GRACE_S after its end, or after the last node came back while they still do (`wave`, per silence)."""
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


def extend(nodes: Iterable[NodeRecord], now: float, by: float, out: Outbox) -> None:
    """Give `nodes` `by` seconds more (the server was cut off or behind, not they); a closed connection stays so."""
    for node in nodes:
        node.lease_expires = now + by
    out.deadline(now + by)


def restored(job: JobRecord, now: float, away_s: float, out: Outbox) -> float:
    """After the server came back on a saved state, `away_s` after it went: every node gets a fresh lease plus one
    more of grace to reconnect (agents find a new leader about a second after it serves: path_check.py); last-call
    and join deadlines, and a wait's bound, move by the time away; cooldowns keep running. Renewals are not saved,
    so a node's silence counts from when the server went away at the latest. Returns the leases' length."""
    grace = 2 * job.config.lease_timeout_s
    for node in job.nodes.values():
        node.last_seen = min(now, max(node.last_seen, now - away_s))
        node.dropped, node.holding = False, 0     # the connections of held polls did not survive the restart
        node.unheard = True           # a member that died with the server looks alive for its lease's time
    extend(job.nodes.values(), now, grace, out)
    if job.last_call_deadline is not None:
        job.last_call_deadline += away_s
        out.deadline(job.last_call_deadline)
    if job.join_deadline is not None:
        job.join_deadline += away_s
        out.deadline(job.join_deadline)
    if job.awaited:
        job.awaited_since += away_s             # its bound moves with the deadline
        for stop in job.stops.values():         # (stops.py) and the stops it counts from
            stop.end, stop.since_before = stop.end + away_s, stop.since_before + away_s
    return grace


def hold_back(job: JobRecord, nodes: list[NodeRecord], now: float, lag_s: float, quiet_s: float,
              out: Outbox) -> None:
    """Judge `nodes` (`lapsed`'s deferred) again once each one's patience has passed, a lease at most."""
    for node in nodes:
        by = min(patience_s(node, now, lag_s, quiet_s), job.config.lease_timeout_s)
        node.lease_expires = now + by
        out.deadline(now + by)


def note_loss(job: JobRecord, node_id: str, now: float, restarted: bool = False) -> None:
    """Remember when a node was lost: a flapping host is kept out when it comes back (admission.py). `restarted`:
    its agent ended with its host alive (its next agent replaced the record, or its host closed the connection),
    a loss only where the node held a place (a member of the round, or of the last one's places while the job
    waits): an operator's restart typed twice (its second agent gone before it ever entered a round) cost the
    others nothing, and made a healthy node "a flapping host", kept out 300s. A host gone silent counts anyway."""
    if restarted and node_id not in (job.round.members if job.round is not None else job.places):
        return
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
