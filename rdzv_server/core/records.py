"""Plain-data records the rendezvous core keeps per job: msgspec structs, so a job's whole state encodes as it is
(for the store and the status API). No behaviour here; the rules are in `job_rules.py`.
"""
from __future__ import annotations

from typing import Any

import msgspec

from protocol.messages import Assignment, JobConfig, JobState, NodeState, Witness, WorkerFailure
from protocol.notes import CopiesNote
from rdzv_server.core.events import EventKind
from rdzv_server.core.goodput import JobProgress
from rdzv_server.core.hangs import HangPlace, StallShown

MAX_EVENTS_PER_JOB = 1000


class NodeRecord(msgspec.Struct, kw_only=True):
    node_id: str
    instance: str
    addr: str
    host: str
    role: str
    local_world_size: int
    master_port: int
    state: NodeState
    joined_at: float
    last_seen: float
    lease_expires: float
    dropped: bool = False              # its long-poll connection closed: lease cut to a short grace
    dropped_at: float = 0.0            # when it closed (leases.grace_after_silence)
    drop_heard: bool = False           # the close came from its host (a FIN or RST just in: leases.closing_heard)
    holding: int = 0                   # its long-polls held open now: the lease waits (leases.py)
    failure_times: list[float] = msgspec.field(default_factory=list)
    alone_failed_at: float = 0.0       # its last report of a worker failing before its process group (blame.py)
    alone_excluded_at: float = 0.0     # when such failures of its own excluded it (blame.readmit_alike)
    suspect_times: list[float] = msgspec.field(default_factory=list)   # when it was a suspect (suspects.py)
    alone_suspects: list[float] = msgspec.field(default_factory=list)  # ... those for exits before its group (blame.py)
    checks_due: bool = False           # a suspect: not ready until its agent's checks pass again (suspects.py)
    exclusions: int = 0                # how often it was excluded (cooldown doubles each time)
    excluded_until: float = 0.0
    held_off: bool = False             # excluded_until is flap damping's hold-off, not a failures' exclusion
    slow_out: bool = False             # ... is a slow node's, swapped for a spare (swaps.py): ends if the job waits
    credential_digest: str = ""        # sha256 of the secret its join was given ("": none was issued)
    credential_used: bool = False      # a request has carried that secret: its agent has it (admission.py)
    seen_from: str = ""                # the address its join came from (as the server saw it)
    witness_port: int = msgspec.field(default=0, name="probe_port")    # where its agent answers as a witness (0: none)
    server_addr: str = ""              # the server's address its join reached
    checks: str = ""                   # what its agent checks of the node (JoinRequest.checks)
    ready: bool = True                 # its workers can start at once: only such nodes enter a round
    preparing_since: float = 0.0       # when it said it was not ready (0: ready)
    preparing_said: bool = False       # preparing past the limit, said once
    domain: str = ""                   # its failure domain (JoinRequest.domain; "": its host)
    copy_port: int = 0                 # where its agent takes peer copies (0: none)
    copy_verifiers: bool = False       # its agent is told verifiers, not tokens, of its sources (JoinRequest)
    copies: CopiesNote | None = None   # its peer copies, as its last poll said
    copied_at: float = 0.0             # when its copied step last changed (floors.copies_floor)
    stepped_at: float = 0.0            # when its newest snapshot's step last changed (floors.held_floor)
    step_gap: float = 0.0              # the time between its last two moves up in a round (its snapshots' interval)
    noted_at: float = 0.0              # when its last note came (floors.held_floor)
    store_per_round: bool = False      # its agent hosts a store per round it masters (JoinRequest; store_port.py)
    unheard: bool = False              # not heard from since the server came back (a failure waits: reports.py)
    answered: bool = False             # its held poll was answered and nothing heard since (a failure waits too)
    fetch_of: str = ""                 # the gone node whose copies a round told it to fetch (rounds.fetches_pending)
    fetch_place: PlaceCopies | None = None    # where those copies were, and the ranks they are of


class HeldFailure(msgspec.Struct, kw_only=True):
    """A round's failure reported while a member was not yet heard from after the server came back, or between its
    polls (reports.fail_round)."""
    node_id: str
    round_id: int
    failures: list[WorkerFailure]
    cause: str
    blamed: bool
    waiting_for: list[str] = msgspec.field(default_factory=list)   # members answered, not yet polling again


class AloneHeld(msgspec.Struct, kw_only=True):
    """A first report of a worker failing before its process group, held while its round runs until another
    member reports or `until` (alone.py)."""
    node_id: str
    round_id: int
    failures: list[WorkerFailure]
    until: float


class Blame(msgspec.Struct, kw_only=True):
    """Whom the last failed round's failure was counted against (blame.py): moved to the root cause's node when a
    later report names an earlier failure."""
    node_id: str
    counted_at: float                   # its entry in that node's failure_times
    excluded: bool = False              # the count excluded it ...
    before: list[float] = msgspec.field(default_factory=list)   # ... and its failure_times before it
    round_start: float = 0.0            # when that round formed: a failure stamped before it never moves blame
    held: list[str] = msgspec.field(default_factory=list)   # nodes it moved off: none takes it back
    members: list[str] = msgspec.field(default_factory=list)   # that round's: only they report its failures


class SwapDue(msgspec.Struct, kw_only=True):
    """A suspect that can go on (a slow node), or a member an operator drained, swapped for a spare at the job's
    next snapshot (swaps.py)."""
    node_id: str
    why: str
    round_id: int                      # the round it is due in (moot once another forms)
    until: float                       # then swapped whatever came (a snapshot may never come)
    held_step: int = -1                # the snapshot step the members hold after (-1: none yet)
    suspect_held: int = -1             # ... and the suspect's own ranks, as its notes said
    drain: bool = False                # an operator's drain: the node goes once the spare fetched (JobRecord.draining)
    spare: str = ""                    # (draining) the spare in its place, whose fetch it serves


class PlaceCopies(msgspec.Struct, kw_only=True):
    """Where a member's snapshot copies went in its last round, and the global ranks they are of."""
    holders: list[str]
    rank_offset: int
    local_size: int
    epoch: int = 0          # the member's copy token epoch there (RoundRecord.copy_epochs): what they came with


class KeptOut(msgspec.Struct, kw_only=True):
    """An exclusion still running when its node's record went (gone_nodes.py): its next agent's join takes it up."""
    until: float
    exclusions: int


class StopKept(msgspec.Struct, kw_only=True):
    """A stopped agent's stop that moved the wait for it (stops.py): when its told stop timeout ends, the wait's start
    before it (`since_before`, `lead`: awaiting.lost_again's), and its credential's digest, which alone may tell the
    stop over (`ended`: told, `end` then when)."""
    digest: str
    end: float
    since_before: float
    lead: float = 0.0
    ended: bool = False


class UnfinishedFetch(msgspec.Struct, kw_only=True):
    """A member lost while it fetched a gone node's copies (NodeRecord.fetch_of), before it held a snapshot."""
    of: str
    place: PlaceCopies


class RoundRecord(msgspec.Struct, kw_only=True, omit_defaults=True, dict=True):
    """One round as formed. Assignments are not kept (smaller to store): rounds.assignment() computes them from
    the columns below, taken from the members' records at formation (later changes do not move a round).
    `dict=True`: rounds.py caches what it derives on the record, never encoded."""
    round_id: int
    members: list[str]                 # node ids by group rank; an excluded node leaves this list
    opened_at: float                   # when the decision to form it was taken (or first node waited)
    completed_at: float
    reason: str
    world_size: int
    restart_count: int
    ranked: list[str] = []             # node ids by group rank, as formed: the columns' order
    local_sizes: list[int] = []
    roles: list[str] = []
    addrs: list[str] = []              # where the other members reach each (addresses.reachable_addresses)
    witness_ports: list[int] = msgspec.field(default_factory=list, name="probe_ports")   # 0: not a witness
    master_port: int = 0
    awaits_port: bool = False          # master_port is its master's last round's: it waits for another (store_port)
    max_restarts: int = 0
    domains: list[str] = []            # each member's failure domain: its copies go to another (rounds.py)
    copy_ports: list[int] = []         # where each member takes peer copies (0: none)
    replicas: int = 0                  # copies of each member's snapshots (JobConfig.replicas)
    replica_key: str = ""              # the job's key for its members' copies (JobRecord.replica_key)
    run: str = ""                      # the job's run (rounds.run_of): Assignment.run
    resume_at_most: int = -1           # Assignment.resume_at_most (after replicas diverged)
    ranks_alike: bool = False          # Assignment.ranks_alike (the job's digests agreed)
    noted_step: int = -1               # Assignment.noted_step (awaiting.noted_step)
    # A node that took a gone node's place -> [that node, the member holding its copies], or [that node, itself,
    # and the holder if any] where it lives on in the job (a suspect swapped out): it serves its own snapshots,
    # at `copies_from`, the holder's copies the second source
    copies: dict[str, list[str]] = {}
    copies_from: dict[str, Witness] = {}
    copy_epochs: dict[str, int] = {}     # its members' and gone nodes' copy token epochs, where not 0 (credentials)
    told_epochs: dict[str, int] = {}     # newcomer -> the epoch the gone node's copies it fetches came with
    copies_wanted: list[str] | None = None    # Assignment.copies_wanted (None: a round saved before it)
    copies_moving: list[str] = []             # Assignment.copies_moving (of copies_wanted)
    # A round saved without the columns: its assignments as they were written.
    legacy: dict[str, Assignment] = msgspec.field(default_factory=dict, name="assignments")


class Event(msgspec.Struct, kw_only=True):
    """One decision or fact in a job's history, with the reason a human reads."""
    t: float
    seq: int                           # per job, grows by one per event
    kind: EventKind
    message: str
    node_id: str = ""
    round_id: int = -1
    data: dict[str, Any] = msgspec.field(default_factory=dict)


class JobRecord(msgspec.Struct, kw_only=True):
    job_id: str
    config: JobConfig
    state: JobState
    created_at: float
    nodes: dict[str, NodeRecord] = msgspec.field(default_factory=dict)
    round: RoundRecord | None = None        # the round now running (None while waiting)
    last_round_id: int = 0                     # ids only grow, across all rounds ever formed
    waiting: list[str] = msgspec.field(default_factory=list)  # admitted, for the next round, in order
    places: list[str] = msgspec.field(default_factory=list)   # while waiting: the last round's, by group rank
    places_port: int = 0            # while waiting: the last round's store port (store_port.py)
    places_at: float = 0.0          # while waiting: when the last round formed (a node joined since is a new one)
    places_sizes: list[int] = msgspec.field(default_factory=list)   # while waiting: their workers ([]: not known)
    waiting_preparing: int = 0      # of `waiting`, the nodes whose workers cannot start at once yet (not ready)
    spares: list[str] = msgspec.field(default_factory=list)
    replica_key: str = ""           # what members' agents show each other with a copy (derived from a secret)
    # While waiting: each member of the last round's copies (rounds.places_kept), for the node taking a place
    place_copies: dict[str, PlaceCopies] = msgspec.field(default_factory=dict)
    # Members gone from the last round that had told a snapshot, with its step, until the next round forms: their
    # holders take their last push up to it (NodeStatus.sources_noted, gone_nodes.note_gone)
    left_steps: dict[str, int] = msgspec.field(default_factory=dict)
    # Members whose round gave their copies other holders, with where their copy still is (moving_copies.py)
    copies_moving: dict[str, PlaceCopies] = msgspec.field(default_factory=dict)
    # Until the next round forms: members lost mid-fetch, for their next agent to fetch again (admission.py)
    unfinished_fetches: dict[str, UnfinishedFetch] = msgspec.field(default_factory=dict)
    copies_off: str = ""            # why the job's rounds make no peer copies, as last said (rounds.copies_off)
    excluded: list[str] = msgspec.field(default_factory=list)
    drained: dict[str, str] = msgspec.field(default_factory=dict)  # node id -> operator's reason: may not join
    loss_times: dict[str, list[float]] = msgspec.field(default_factory=dict)  # node id -> when it was lost
    copy_epochs: dict[str, int] = msgspec.field(default_factory=dict)    # node id -> its copy token's epoch (not 0)
    copies_told: list[str] = msgspec.field(default_factory=list)    # nodes whose copy token another node was told
    kept_out: dict[str, KeptOut] = msgspec.field(default_factory=dict)   # excluded nodes gone meanwhile (gone_nodes)
    gone_members: dict[str, str] = msgspec.field(default_factory=dict)   # gone members: credential digest
    join_config: JobConfig | None = None    # the config joins must match, once an operator resized the job
    command: str = ""                       # fingerprint of the command every node runs ("": not checked)
    launcher: str = ""                      # what starts every node's workers (JoinRequest.launcher; "": not said)
    restart_count: int = 0
    forming_since: float | None = None      # when the next round started forming
    last_call_deadline: float | None = None
    last_call_held: float = 0.0             # the end of the last call a hold runs past (leases.hold_last_call)
    awaited: list[str] = msgspec.field(default_factory=list)   # while waiting: members restarting, kept until the
    #                                                             last call's deadline (awaiting.py) ...
    awaited_since: float = 0.0                                  # ... from when (its bound: awaiting.deadline)
    stops_counted: list[str] = msgspec.field(default_factory=list)  # whose stop moved this wait (once each)
    stops: dict[str, StopKept] = msgspec.field(default_factory=dict)   # their stops, until over (stops.py)
    join_deadline: float | None = None
    successes: list[str] = msgspec.field(default_factory=list)
    root_cause: WorkerFailure | None = None        # first failure in time of the last failed round
    root_cause_round: int = -1
    root_cause_members: list[str] = msgspec.field(default_factory=list)   # that round's, as it failed
    last_failure: WorkerFailure | None = None
    blame: Blame | None = None                   # who root_cause_round's failure counts against (blame.py)
    held_failure: HeldFailure | None = None      # a failure judged once every member is heard (reports.py)
    alone_held: AloneHeld | None = None          # a failure at start judged once the others say theirs (alone.py)
    finished_at: float | None = None
    reason: str = ""                           # the latest decision's reason
    epoch: int = 0                             # bumped when any node's assignment view may change
    event_seq: int = 0
    events: list[Event] = msgspec.field(default_factory=list)
    progress: JobProgress = msgspec.field(default_factory=JobProgress)   # steps, restarts' costs (goodput.py)
    stall: StallShown | None = None            # ranks alone, or in long collectives, now (hangs.py)
    hang_places: list[HangPlace] = msgspec.field(default_factory=list)   # decided by a limit: not again
    resume_at_most: int = -1                   # for the next round: replicas diverged after this step (-1: none)
    swap: SwapDue | None = None                # a suspect swapped at the next snapshot (swaps.py)
    draining: SwapDue | None = None            # a drained node swapped out, serving its spare's fetch (swaps.py)
    swapped_places: list[int] = msgspec.field(default_factory=list)   # group ranks a slow node was swapped from
    swapped_from: dict[str, int] = msgspec.field(default_factory=dict)  # slow node swapped out -> its group rank
    copies_floor: int = -1                     # floors.copies_floor, as the members' last notes give it
    held_floor: int = -1                       # floors.held_floor, likewise
    writes_end_round: int = -1                 # NodeStatus.writes_end_round (requests.leave)
    copies_floor_at: float = 0.0               # when they were last worked out
    restored_at: float = 0.0                   # when the server last came back on a saved state (0: never)

    def events_after(self, seq: int) -> list[Event]:
        """The kept events newer than `seq` (seqs are consecutive, so no scan of the history)."""
        newer = self.event_seq - seq
        return self.events[-newer:] if newer > 0 else []

    def record(self, event: Event) -> None:
        self.event_seq += 1
        event.seq = self.event_seq
        self.events.append(event)
        if len(self.events) > MAX_EVENTS_PER_JOB:
            del self.events[: len(self.events) - MAX_EVENTS_PER_JOB]
