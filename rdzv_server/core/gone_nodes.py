"""What outlives a node's record when it goes (lost, left, drained), for its next agent's join (admission.py) or its
copies' holders:
- the newest snapshot step a member's last note told, while the job waits (JobRecord.left_steps): its holders take
  its last push up to it, though their own ranks never got there (a newcomer that never stepped);
- a fetch it had not finished (a member lost while it fetched a gone node's copies, before it held a snapshot):
  fetched again at its place, else its ranks hold nothing and every rank goes back with them;
- an exclusion still running: its cooldown runs on. An agent restarted (by hand, or by a service manager) must not
  bring a node excluded for its failures straight back into the job (a review: its next agent joined as a member).
  At most MAX_KEPT_OUT are kept (those ended are let go first): made-up node ids cannot grow the job's record;
- a member's credential digest, kept for as long as the job's record: once the run succeeded, its next agent (which
  shows the secret its predecessor left in the node's memory) has nothing left to run (`took_part`). At most
  MAX_KEPT_OUT, the oldest let go first."""
from __future__ import annotations

import hmac

from protocol.messages import NodeState
from protocol.notes import CopiesNote
from rdzv_server.core import awaiting, credentials
from rdzv_server.core.records import JobRecord, KeptOut, NodeRecord, UnfinishedFetch

MAX_KEPT_OUT = 1024


def note_gone(job: JobRecord, node: NodeRecord, now: float, was_member: bool) -> None:
    """Keep what `node`'s next agent takes up (called as its record goes). A member of the last round counts while
    the job waits for nodes too (no round runs then: a review lost a member while the job awaited another's restart,
    and its next agent, refused as late once the job succeeded without it, would have trained a new run alone; and
    one stopped as a fixed-size job waited for a lost member: its holders were never told its last note's step)."""
    ran = was_member or job.round is None and node.node_id in job.places
    if ran and node.credential_digest:
        job.gone_members.pop(node.node_id, None)         # (kept newest last: the oldest goes first)
        job.gone_members[node.node_id] = node.credential_digest
        for oldest in list(job.gone_members)[:max(0, len(job.gone_members) - MAX_KEPT_OUT)]:
            del job.gone_members[oldest]
    if ran and node.copies is not None and node.copies.local_step >= 0:    # what its last push may be of
        job.left_steps[node.node_id] = node.copies.local_step
    if was_member and node.fetch_place is not None and awaiting.fetch_unfinished(node):
        job.unfinished_fetches[node.node_id] = UnfinishedFetch(of=node.fetch_of, place=node.fetch_place)
    # (a flapping host's hold-off: its losses are kept; a drained node swapped out is held out by its drain, not an
    # exclusion: kept as one, the views listed it excluded for a minute more after it went, as if it came back then)
    draining = job.draining is not None and job.draining.node_id == node.node_id
    if node.excluded_until > now and not node.held_off and not draining:
        for ended in [nid for nid, kept in job.kept_out.items() if kept.until <= now]:
            del job.kept_out[ended]
        if len(job.kept_out) < MAX_KEPT_OUT:
            job.kept_out[node.node_id] = KeptOut(until=node.excluded_until, exclusions=node.exclusions)


def take_up(job: JobRecord, node: NodeRecord, now: float, fresh: bool) -> bool:
    """A new record of the node takes up what its gone one left (`fresh`: no previous record handed it over).
    Returns whether it took up an exclusion (its join's event says so, not that its agent restarted)."""
    unfinished = job.unfinished_fetches.pop(node.node_id, None)
    if unfinished is not None:
        node.fetch_of, node.fetch_place = unfinished.of, unfinished.place
        node.copies = CopiesNote(local_step=-1)
    kept = job.kept_out.pop(node.node_id, None)
    if fresh and kept is not None and kept.until > now:
        node.excluded_until, node.exclusions = kept.until, kept.exclusions
        return True
    return False


def took_part(job: JobRecord, node_id: str, predecessor: str, instance: str) -> bool:
    """Whether a join of another agent instance showing `predecessor` comes from the next agent of one whose workers
    ran in this job's run as a member (a member still, or gone from it): proven by the secret that agent was given.
    A review: such a node, killed near the end of an elastic job that then succeeded without it, was refused as late
    (exit 1) and its service manager's next try, past the refusal's 10 s, trained a new run alone from step 0."""
    node = job.nodes.get(node_id)
    if node is not None:
        if node.credential_digest and node.state is NodeState.MEMBER and credentials.succeeds(node, predecessor,
                                                                                               instance):
            return True
        if not instance or instance == node.instance:       # the record's own agent: no next one
            return False
    # A gone member's secret proves it though another agent's record is there: an agent keeps its secret in the
    # node's memory only as its workers start, so a next agent that waited past the end (no round, exit 1) left
    # its predecessor's there (a review: the agent after it was refused as late, and a later one trained a new run)
    kept = job.gone_members.get(node_id, "")
    return bool(kept) and bool(predecessor) and hmac.compare_digest(credentials.digest(predecessor), kept)
