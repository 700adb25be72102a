"""A member whose agent restarts keeps its place: the job waits for it, bounded, rather than going on without it.

An agent restarted under its own id (an OOM kill, systemd's or a container's restart) closes its connection and
joins again seconds later, its memory directory in place. Were the round formed without it, an elastic job would
shrink: the last survivor moves into its place and takes its ranks, so the last ranks' state (shards, a rank's own
RNG) is dropped, and the regrown round finds no common step: every rank goes back to disk or to step 0. A spare's
fetch of a lost node's copies from the restarting node fails the same way. So a member lost with its connection
closed by its host, replaced by a new instance of its agent, or leaving because its agent was stopped by a signal
(`systemctl restart`: LeaveRequest.stopped), that holds state of its own (`holds_own_state`), is awaited for
`window_s` (a lease and a last call), a ready spare or not (`worth_awaiting`), while the survivors wait; back but
still preparing, until its agent would start cold (`deadline`: a loaded host imports for seconds, and the survivors'
idle seconds cost less than every rank's progress). A stopped agent leaves before it stops its workers: its wait
starts when they may be stopped (LeaveRequest.stop_timeout_s: a script saving a checkpoint on SIGTERM would
otherwise be gone on without while it saves), or when it says its stop is over, if sooner (stops.py). What looks
the same: an agent that crashed or was stopped for good, or a host closing its connections as it shuts down: the
job goes on without it (or a spare takes its place) that much later, and the event says why. A host that keeps
dropping out (a flapping host, exclude_lost_after), a node that leaves unhealthy and a drained one are not
awaited.
"""
from __future__ import annotations

from protocol.bounds import MAX_NODES, MAX_PREPARE_S
from protocol.messages import JobConfig, NodeState
from rdzv_server.core import leases
from rdzv_server.core.records import JobRecord, NodeRecord, StopKept


def window_s(cfg: JobConfig) -> float:
    """How long a restarting member is awaited: its lease (what a silent one gets) and a last call."""
    return cfg.lease_timeout_s + cfg.last_call_s


def deadline(job: JobRecord, now: float, back: bool = False) -> float:
    """The wait's end once more is awaited at `now`: another member lost meanwhile gets a window from now, never
    past two windows from the wait's start, whatever comes and goes (an agent that keeps crashing as it starts
    would otherwise hold the job for good); one `back` still preparing (its warm interpreter importing) as long
    as its agent waits for that (MAX_PREPARE_S) more, only while one is (one lost again ends the extension)."""
    current = capped(job, job.last_call_deadline if job.last_call_deadline is not None else now)
    return max(current, bound(job) + MAX_PREPARE_S if back else min(now + window_s(job.config), bound(job)))


def resume(job: JobRecord, now: float, ready: str) -> float:
    """Set the wait's end once enough nodes are back after the job fell below min_nodes while awaiting members
    (their wait resumes, within its bound; one of them back and still preparing gets its time, as `came_back`
    gives), and say it in the job's reason (`ready`: who is ready). The end."""
    job.last_call_deadline = deadline(job, now, back=any(preparing(job, n) for n in job.awaited))
    job.reason = f"{ready} ready; {waiting(job, now)}"
    return job.last_call_deadline


def wait_runs(job: JobRecord) -> bool:
    """The job waits for members restarting, its end set; awaited with none set, it is short of nodes (below
    min_nodes: no wait runs until enough are back, JobRules.grow)."""
    return bool(job.awaited) and job.last_call_deadline is not None


def bound(job: JobRecord) -> float:
    """Two windows from the wait's start."""
    return job.awaited_since + 2 * window_s(job.config)


def capped(job: JobRecord, end: float) -> float:
    """`end`, no later than the wait's bound, MAX_PREPARE_S past it while a node awaited is back and preparing."""
    return min(end, bound(job) + (MAX_PREPARE_S if any(preparing(job, n) for n in job.awaited) else 0.0))


def flapping(job: JobRecord, node_id: str, now: float) -> bool:
    """A restart is a flapping host's once the node was lost exclude_lost_after + 1 times within exclude_window_s
    (this loss counted): flap damping keeps it out, so it is not awaited. One more than a host that goes silent
    gets, because here damping costs the most: the job shrinks, and when it grows again every rank goes back to
    disk or step 0 (two OOM kills of one agent in ten minutes are awaited both times). An agent in a crash loop
    still costs the others at most one round per loss, exclude_lost_after + 1 of them per window."""
    cfg = job.config
    return bool(cfg.exclude_lost_after) and leases.recent_losses(job, node_id, now) > cfg.exclude_lost_after


def worth_awaiting(job: JobRecord, lost: list[NodeRecord], now: float) -> list[str]:
    """Of `lost` (members whose agents may be restarting, their memory holding state of their own), those the job
    waits for, bounded: all but a flapping host's. Even where a spare could take the place at once: its copy of the
    node's state may lag the node's own (its note a second behind its snapshots, or pushes slower than them), its
    holder may be lost or replaced in the same event, and the node may hold others' copies that only it serves. A
    review saw each send every rank back a snapshot, or to step 0, where the node's agent, back in seconds, had
    everything. The spare takes the place when the wait runs out. A drained node is not awaited: its next agent's join
    is refused (a review: every rank stood idle a window for a node drained, then lost, before its swap)."""
    return [n.node_id for n in lost if not flapping(job, n.node_id, now) and n.node_id not in job.drained]


def copy_behind(node: NodeRecord) -> bool:
    """Whether the node's newest snapshot is newer than its newest copy at a peer (or none landed, or its round makes
    none): a spare taking its place would resume every rank from that older copy, or from step 0, where its own
    agent, back in seconds, resumes from the newest. Waiting a window costs the survivors seconds; the steps a copy
    lags may be minutes of training."""
    c = node.copies
    return c is not None and c.local_step > c.copied_step


def held_back(standby: dict[str, str], lost: list[NodeRecord]) -> str:
    """Why each newcomer that would take an awaited node's place stays spare meanwhile (`standby`: newcomer -> the
    node whose place it would take; `lost`: the awaited nodes' records), for the job's reason: an operator seeing a
    ready spare idle asks."""
    records = {n.node_id: n for n in lost}
    said = []
    for new, gone in list(standby.items())[:3]:
        node = records.get(gone)
        c = node.copies if node is not None else None
        if node is not None and c is not None and copy_behind(node):
            copy = f"its copy of step {c.copied_step}" if c.copied_step >= 0 else \
                "no copy its agent has told of (none landed yet, or its new agent pushed none yet)"
            said.append(f"spare {new} stays spare: it would resume {gone}'s ranks from {copy}, where {gone}'s own "
                        f"newest is step {c.local_step}")
        else:
            said.append(f"spare {new} stays spare while {gone}'s agent restarts: its memory holds {gone}'s newest "
                        f"state, and copies it may hold for others")
    return "; ".join(said)


def lost_again(job: JobRecord, node: NodeRecord, now: float, restarting: bool, stopping_s: float = 0.0) -> bool:
    """A node of the last round's places lost (or replaced) while the job waits for the awaited ones: awaited too
    where its agent may be restarting (else the round formed on their return would fill its place from the end), its
    window from when its workers are stopped (`stopping_s` from now; the wait's bound moves with it), but one
    awaited that is lost again as a flapping host, or not as a restart, is not any more. Whether the wait goes on:
    someone is still awaited and not everyone awaited is back."""
    nid = node.node_id
    if nid in job.places and restarting and not flapping(job, nid, now):
        if nid in job.awaited or nid in job.stops_counted:    # a node's stop moves the wait once: back, or given
            stopping_s = 0.0                                      # up, and stopped again, the bound stays a bound
        if nid not in job.awaited:
            job.awaited.append(nid)
        if stopping_s:
            job.stops_counted.append(nid)
            if node.credential_digest:           # to be told over (stops.py)
                # the wait's start before any stop moved it (another's told end is no part of this one's)
                base = min((s.since_before for s in job.stops.values()), default=job.awaited_since)
                job.stops[nid] = StopKept(digest=node.credential_digest, end=now + stopping_s,
                                          since_before=base, lead=window_s(job.config))
            job.awaited_since = max(job.awaited_since, now + stopping_s - window_s(job.config))
        job.last_call_deadline = deadline(job, now + stopping_s)
        return True
    return not given_up(job, nid)


def given_up(job: JobRecord, node_id: str) -> bool:
    """`node_id` is awaited no more (lost again, drained): whether that ends the wait (nobody else awaited, or
    every other one back and ready: the round may form now); else its end comes back within its bound (time a
    node preparing had moved it by is not kept for the others)."""
    if node_id in job.awaited:
        job.awaited.remove(node_id)
    job.stops.pop(node_id, None)
    if not job.awaited or all_back(job):
        return True
    if job.last_call_deadline is not None:
        job.last_call_deadline = capped(job, job.last_call_deadline)
    return False


def restarting(job: JobRecord, node: NodeRecord) -> bool:
    """A lost member whose host closed its connection (FIN or RST while the link worked: its agent's process ended,
    the host lives), or not heard from since the server came back (its agent killed or stopped while the server
    was away: nobody heard how it ended), and whose memory holds state of its own; a host gone silent under a
    running server (a lease run out, a keepalive given up) is not awaited. (One replaced by a new instance of its
    agent: admission.py.)"""
    return (node.dropped and node.drop_heard or node.unheard) and holds_own_state(job, node)


def holds_own_state(job: JobRecord, node: NodeRecord) -> bool:
    """Whether going on without the node may lose state only it holds: its last note told an in-memory snapshot, or
    it was fetching a gone node's copies (a spare that took its place: its next agent fetches them again), or it is
    the new agent of a member the job awaits (its memory is its predecessor's; it has told nothing yet: a review
    killed it again as it prepared, and the job, no longer waiting, shrank and regrew to step 0), and the job's
    ranks are not known to be replicas of each other (DDP: the job's digests agreed, and a rank without the step is
    lent it). A job without snapshots in memory, or of replicas, loses nothing by shrinking and is not made to wait
    (an agent killed for good: the survivors go on within a second or two). HSDP's digests agree too, but only
    within each shard (`alike_step`, not `all_alike`): no rank is lent another's shard, and a review saw such a job
    not wait for a restarted agent, shrink and go back to step 0. Replicas or not, a node whose round's others hold
    no snapshot (a newcomer that never stepped) is awaited: its last push has yet to land (a review: a lone node
    stopped as a replica joined, and the job went back to step 0)."""
    return held_state(job, node) and (not job.progress.all_alike or not others_hold(job, node.node_id))


def held_state(job: JobRecord, node: NodeRecord) -> bool:
    """Whether the node's memory holds state (a snapshot told, a fetch unfinished, a new agent of one awaited)."""
    return fetch_unfinished(node) or node.copies is not None and node.copies.local_step >= 0 or \
        node.copies is None and node.node_id in job.awaited


def ranks_own_state(job: JobRecord, node: NodeRecord) -> bool:
    """Whether the node's ranks hold state no other rank can lend (what a change of size loses): held, and the
    ranks not replicas. Not holds_own_state: a lone replica holder is awaited, but a rank of a job of replicas that
    grows is lent its step (a review: DDP growing from one node was told every rank went back to step 0)."""
    return held_state(job, node) and not job.progress.all_alike


def others_hold(job: JobRecord, node_id: str) -> bool:
    """Whether another member of the job's round noted a snapshot of its own."""
    members = job.round.members if job.round is not None else list(job.nodes)
    return any(m != node_id and (n := job.nodes.get(m)) is not None and n.copies is not None and
               n.copies.local_step >= 0 for m in members)


def noted_step(job: JobRecord, members: list[str]) -> int:
    """The newest snapshot step the members noted (Assignment.noted_step; -1: none): a newcomer's holder takes a
    push up to it (a review: a lone node's last push, "ahead" of a replica that never stepped, was lost)."""
    return max((n.copies.local_step for m in members if (n := job.nodes.get(m)) is not None and n.copies is not None),
               default=-1)


def fetch_unfinished(node: NodeRecord) -> bool:
    """The node was told to fetch a gone node's copies (rounds.build_round) and has told no snapshot since, or, its
    round making copies, no copy of its own landed yet: the gone node's copies are the place's only state off the
    node until then (its agent drops them only then: a review lost the node in between, and every rank went to 0)."""
    return bool(node.fetch_of) and node.fetch_place is not None and (
        node.copies is None or node.copies.local_step < 0 or node.copies.copying and node.copies.copied_step < 0)


def copies_wanted(job: JobRecord, members: list[str], told: dict[str, list[str]]) -> tuple[list[str], list[str]]:
    """The gone nodes whose copies a node may still fetch, as a round forms (Assignment.copies_wanted): those it tells
    (`told`), those members were told before and may not have ended (fetch_of: kept until a round after their own
    copy landed), those lost mid-fetch, and the places a waiting job keeps. No other gone node's copies can be asked
    for: a round names only its last round's members' places (rounds.build_round), so their holders free that room.
    Second, of them, the live members moving (Assignment.copies_moving): a holder drops theirs to make room for its
    sources' pushes, never a gone one's (a replacement fetches those)."""
    wanted = {gone for gone, *_ in told.values()} | {u.of for u in job.unfinished_fetches.values()}
    # A waiting job's places are every last member's: only the gone ones' copies are at stake (the members' own
    # would make each member's assignment O(nodes), and the server's round O(nodes^2): a review)
    wanted |= {of for m in members if (of := job.nodes[m].fetch_of)} | (set(job.place_copies) - set(members))
    # Live members whose new holders have no copy yet: their old ones keep it (the gone first within the bound)
    moving = sorted(set(job.copies_moving) - wanted)[:max(0, MAX_NODES - len(wanted))]
    return sorted(wanted | set(moving)), moving


def resized(job: JobRecord, before: list[str], after: list[str], was_awaited: bool = False) -> str:
    """What a round-formed message says when a job whose ranks hold their own state changes its number of nodes
    ("": it does not): memory cannot reshard such state. A shrink leaves its last ranks' snapshots unused, and a
    growth adds ranks no snapshot is of, so every rank resumes from the script's own checkpoint or from step 0.
    Said where it happens, with what keeps the job's size, rather than found in the steps redone. Such a job is
    one a member's notes say so of, or one that was awaiting members (every agent restarted: new records that
    have told nothing yet)."""
    # (a job of replicas awaited a lone holder: a rank that joins is lent its step)
    own_state = (was_awaited and not job.progress.all_alike or
                 any(ranks_own_state(job, job.nodes[n]) for n in after if n in job.nodes))
    if not before or len(before) == len(after) or not own_state:
        return ""
    if len(after) < len(before):
        return (f"; the job shrinks from {len(before)} to {len(after)} nodes and its ranks hold their own state: "
                f"when it grows again, no snapshot in memory is of the new ranks and every rank resumes from the "
                f"script's own checkpoint, or from step 0 (a spare keeps the job's size; `rdzv-ctl resize "
                f"{job.job_id} --nnodes {len(after)}:{len(after)}` keeps this one)")
    return (f"; the job grows from {len(before)} to {len(after)} nodes and its ranks hold their own state: no "
            f"snapshot in memory is of the new ranks, so every rank resumes from the script's own checkpoint, or "
            f"from step 0")


def ranks_moved(job: JobRecord, ranked: list[str], sizes: list[int], was_awaited: bool = False) -> str:
    """What a round-formed message says when, at the same number of nodes, a member's new agent runs another number
    of workers (its --nproc-per-node changed, or a GPU fewer under `gpu`) in a job whose ranks hold their own state
    ("": none did): its ranks and those after it move, no snapshot in memory is of them, and every rank resumes from
    the script's own checkpoint, or from step 0; where the last node alone runs fewer, no rank moves and its last
    ranks' state is what goes. `ranked`, `sizes`: the last round's places and workers."""
    r = job.round
    if r is None or len(ranked) != len(r.ranked) or len(sizes) != len(ranked) or len(r.local_sizes) != len(r.ranked):
        return ""
    # (a job of replicas awaited a lone holder: a rank that joins is lent its step)
    own_state = (was_awaited and not job.progress.all_alike or
                 any(ranks_own_state(job, job.nodes[n]) for n in r.ranked if n in job.nodes))
    was, now = dict(zip(ranked, sizes, strict=True)), dict(zip(r.ranked, r.local_sizes, strict=True))
    changed = [n for n in r.ranked if n in was and was[n] != now[n]]
    if not own_state or not (changed or sum(sizes) != r.world_size):
        return ""
    last = r.ranked[-1]
    if changed == [last] and ranked == r.ranked and now[last] < was[last]:    # no rank moves: the last ones go
        first = r.world_size
        gone = f"rank {first} and the state it held is" if sum(sizes) - first == 1 else \
            f"ranks {first}-{sum(sizes) - 1} and the state they held are"
        return (f"; node {last} runs {now[last]} worker{'s' * (now[last] != 1)} where it ran {was[last]}: the world "
                f"size goes from "
                f"{sum(sizes)} to {r.world_size}; no rank moves, but the job's ranks hold their own state and {gone} "
                f"gone")
    told = ", ".join(f"node {n} runs {now[n]} workers where it ran {was[n]}" for n in changed[:3]) or \
        "a node taking a place runs another number of workers"
    return (f"; {told}: the world size goes from {sum(sizes)} to {r.world_size} and ranks move; the job's ranks "
            f"hold their own state, so no snapshot in memory is of them and every rank resumes from the script's own "
            f"checkpoint, or from step 0")


def reserved(job: JobRecord) -> int:
    """Places the awaited members hold while they are not back and ready: a newcomer that would fill max_nodes
    meanwhile waits as a spare (a review: with a spare, every member restarted together and the first ones back
    filled the round before the last one was ready, every rank from step 0); it gets a place if the wait ends
    without them. An awaited member back always waits at its place (JobRules.admit)."""
    return sum(1 for n in job.awaited if not back(job, n))


def taker_preparing(job: JobRecord, now: float) -> str:
    """At the wait's end, a node that would take an awaited member's place (a newcomer, waiting or spare) and is
    still preparing while too few takers are ready: waited for as a member back and preparing is, as long as its
    agent waits for its imports (a review: a replacement joined a second after the loss and was ready 11 s later;
    the 2:3 job shrank at the 8 s wait's end and grew again with it: every rank from step 0). "" where none."""
    if all_back(job) or now >= bound(job) + MAX_PREPARE_S:
        return ""
    takers = [n for n in job.waiting + job.spares if n not in job.places and n in job.nodes]
    away = sum(1 for n in job.awaited if not back(job, n))
    if sum(1 for n in takers if job.nodes[n].ready) >= away:
        return ""
    return next((n for n in takers if not job.nodes[n].ready), "")


def wait_for_taker(job: JobRecord, node_id: str, now: float) -> float:
    """The wait's end moved for `node_id` preparing (`taker_preparing`); said in the job's reason."""
    job.last_call_deadline = bound(job) + MAX_PREPARE_S
    away = [n for n in job.awaited if not back(job, n)]
    job.reason = (f"{names(job, away)} not back; node {node_id}, to take the place, still preparing: waiting up to "
                  f"{round(job.last_call_deadline - now, 1):g}s for it to be ready (a job whose ranks hold their own "
                  f"state would otherwise shrink, and grow again with it from step 0)")
    return job.last_call_deadline


def taker_ready(job: JobRecord, node: NodeRecord, now: float) -> bool:
    """`node`, a newcomer the wait was moved for (`wait_for_taker`: past its bound, no member awaited preparing),
    is ready: the wait ends now (its end set to `now`)."""
    if not (wait_runs(job) and node.node_id not in job.places and job.last_call_deadline is not None and
            job.last_call_deadline > bound(job) and not any(preparing(job, n) for n in job.awaited)):
        return False
    job.last_call_deadline = now
    return True


def all_back(job: JobRecord) -> bool:
    """Every awaited node has joined again and can start at once: the round forms now."""
    return all(back(job, n) for n in job.awaited)


def back(job: JobRecord, node_id: str) -> bool:
    node = job.nodes.get(node_id)
    return node is not None and node.ready and node.state == NodeState.WAITING


def preparing(job: JobRecord, node_id: str) -> bool:
    node = job.nodes.get(node_id)
    return node is not None and not node.ready and node.state == NodeState.WAITING


def waiting(job: JobRecord, now: float) -> str:
    """What the job waits for, and how long (the job's reason and its round_waiting event say it)."""
    left = (job.last_call_deadline or now) - now
    away = [n for n in job.awaited if not back(job, n) and not preparing(job, n)]
    slow = [n for n in job.awaited if preparing(job, n)]
    what = " and ".join(([f"{names(job, away)} to come back"] if away else []) +
                        ([f"{names(job, slow)} to be ready"] if slow else [])) or names(job)
    why = "an agent restarting keeps its place"
    if job.progress.all_alike and (lone := [n for n in job.awaited if not others_hold(job, n)]):  # why replicas wait
        why += (f"; the ranks are replicas, but only the memory of {names(job, lone)} holds a snapshot: a last copy "
                f"sent as its agent stops lands meanwhile")
    if not wait_runs(job):
        return f"waiting for nodes, and for {what} ({why})"
    return f"waiting up to {round(left, 1):g}s for {what} ({why})"


def came_back(job: JobRecord, node: NodeRecord, now: float) -> bool:
    """`node`, awaited, joined again or said it is ready (or preparing again): still preparing (its warm
    interpreter importing), the wait goes on while it prepares (`deadline`); ready, time it had moved the end by
    is not kept for the others still away. The job's reason says who is still waited for. Whether the wait's
    end may have moved (the caller reschedules its tick)."""
    if node.node_id not in job.awaited or job.last_call_deadline is None:
        return False
    if preparing(job, node.node_id):
        job.last_call_deadline = deadline(job, now, back=True)
        job.reason = f"node {node.node_id} back, its workers preparing; {waiting(job, now)}"
    else:
        job.last_call_deadline = capped(job, job.last_call_deadline)
        job.reason = f"node {node.node_id} back and ready; {waiting(job, now)}"
    return True


def not_back(job: JobRecord) -> str:
    """Why the wait ended without them: counted from their agents' end (a stopped one's: its workers' stop), or
    back but never ready."""
    missing = [n for n in job.awaited if not back(job, n) and not preparing(job, n)]
    whose = "its agent's" if len(missing) == 1 else "their agents'"
    gone = f"{names(job, missing)} not back within {window_s(job.config):g}s of {whose} end" if missing else ""
    slow = [n for n in job.awaited if preparing(job, n)]
    said = f"{names(job, slow)} back but still preparing at the wait's end" if slow else ""
    return "; ".join(part for part in (gone, said) if part)


def names(job: JobRecord, nodes: list[str] | None = None) -> str:
    nodes = job.awaited if nodes is None else nodes
    shown = ", ".join(nodes[:5]) + (" ..." if len(nodes) > 5 else "")
    return f"node{'s' if len(nodes) > 1 else ''} {shown}"
