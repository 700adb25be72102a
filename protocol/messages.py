"""Typed messages exchanged by agents and the server, encoded as MessagePack maps keyed by these field names.
Rules that keep the wire open to other implementations:
- every request carries `v`, the protocol version; the server refuses versions it does not speak;
- unknown fields are ignored (an old server reads a newer agent), missing optional fields take defaults;
- a field of the wrong type or out of range is rejected with an error that names it (`$.field`).
Messages holding only values (nothing that could point back at them) skip the cyclic GC (`gc=False`): a server
builds one Assignment and one NodeStatus per node per round change, too many to walk in every young collection."""
from __future__ import annotations

import enum
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from protocol.bounds import (
    MAX_COMMAND,
    MAX_CREDENTIAL,
    MAX_EXCLUDE_AFTER,
    MAX_LOCAL_WORLD_SIZE,
    MAX_MESSAGE,
    MAX_NODES,
    MAX_POLL_WAIT_S,
    MAX_REASON,
    MAX_REPLICAS,
    MAX_RESTARTS,
    MAX_ROUND,
    MAX_SHORT_TEXT,
    MAX_STOP_S,
    MAX_TRACEBACK,
    Nodes,
    Port,
    PositiveSeconds,
    Rank,
    RoundRef,
    Seconds,
    ShortText,
    UnixTime,
    Workers,
    check,
    printable,
)
from protocol.ids import NODE_ID, NODE_ID_RULE
from protocol.notes import CopiesNote, ProgressNote, SourceStep
from protocol.quoting import quote
from protocol.stalls import RankSeen

PROTOCOL_VERSION = 1

class JobState(str, enum.Enum):
    WAITING = "waiting"        # no round running: collecting nodes (first round, or below min after a loss)
    RUNNING = "running"        # a round is assigned and its workers run
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CLOSED = "closed"          # closed by an operator

    @property
    def finished(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CLOSED)


class NodeState(str, enum.Enum):
    WAITING = "waiting"        # admitted, waiting for the next round to complete
    MEMBER = "member"          # in the current round (see assignment)
    SPARE = "spare"            # job is at max nodes: promoted when a member is lost
    EXCLUDED = "excluded"      # failed too often: waits out a cooldown
    GONE = "gone"              # lost, left or never joined: must join again


class JobConfig(msgspec.Struct, kw_only=True, frozen=True):
    """A job's settings, fixed by its first join; durations in seconds. The one definition of every job setting
    and its default: the agent's command line, the wire and docs/protocol.md all take them from here."""
    min_nodes: Nodes = 1
    max_nodes: Nodes = 1
    max_restarts: Annotated[int, Meta(ge=0, le=MAX_RESTARTS)] = 0   # torchrun's default
    last_call_s: Seconds = 3.0
    join_timeout_s: PositiveSeconds = 600.0
    lease_timeout_s: PositiveSeconds = 5.0
    exclude_after: Annotated[int, Meta(ge=0, le=MAX_EXCLUDE_AFTER)] = 3   # worker failures of one node within ...
    exclude_window_s: PositiveSeconds = 600.0
    exclude_cooldown_s: Seconds = 60.0   # ... exclude it this long, doubling each time
    exclude_cooldown_max_s: Seconds = 3600.0
    exclude_lost_after: Annotated[int, Meta(ge=0, le=1000)] = 2   # losses of one node within exclude_window_s ...
    exclude_lost_cooldown_s: Seconds = 300.0   # ... keep it out this long when it comes back (a flapping host)
    # Hangs (rdzv_server/core/hangs.py, docs/fault-tolerance.md): a rank stopped or gone while the others wait,
    # or every rank blocked in torch.distributed with nothing moving, is decided at once; a rank working alone
    # while the others wait only after hang_alone_timeout_s; ranks waiting while data still moves (or with no
    # evidence either way) after hang_timeout_s, the hard cap. 0: never, for either limit.
    hang_detection: bool = True
    hang_timeout_s: Seconds = 600.0
    hang_alone_timeout_s: Seconds = 1800.0
    replace_slow_nodes: bool = False   # a node named slow is drained, for a spare to take its place
    # Exit codes by which a worker asks to run on other hardware (Megatron's 16: "run this step again
    # elsewhere", 17: "a validation failed"): its node is a suspect, replaced by a ready spare at once
    # (rdzv_server/core/suspects.py). (): none.
    suspect_exit_codes: Annotated[tuple[Annotated[int, Meta(ge=1, le=255)], ...], Meta(max_length=16)] = (16, 17)
    # Peer copies (node_agent/copies/): each member's agent copies its ranks' newest in-memory snapshot to this
    # many other members, in another failure domain; a node taking a lost node's place fetches them. 0: off.
    replicas: Annotated[int, Meta(ge=0, le=MAX_REPLICAS)] = 1

    def __post_init__(self) -> None:
        check(self.max_nodes >= self.min_nodes, "max_nodes",
               f"must be >= min_nodes ({self.min_nodes}), got {self.max_nodes}")

    def differences(self, other: JobConfig) -> list[str]:
        """Human-readable `field: ours vs theirs` for every field that differs."""
        return [f"{name}: job has {getattr(self, name)!r}, join asked {getattr(other, name)!r}"
                for name in self.__struct_fields__ if getattr(self, name) != getattr(other, name)]


class _Request(msgspec.Struct, kw_only=True):
    v: int
    node_id: str
    # The node's secret from the reply to its join; every later request for the node carries it.
    credential: Annotated[str, Meta(max_length=MAX_CREDENTIAL)] = ""

    def __post_init__(self) -> None:
        check(bool(NODE_ID.fullmatch(self.node_id)), "node_id", f"must be {NODE_ID_RULE}, got {quote(self.node_id)}")


class JoinRequest(_Request, kw_only=True):
    """Admit this node to the job, creating the job with `config` if it is new."""
    addr: Annotated[str, Meta(min_length=1, max_length=MAX_SHORT_TEXT)]   # where other nodes reach this one
    local_world_size: Workers
    master_port: Port                  # a free port on this node, used if it becomes group rank 0
    # True: its agent hosts a new store for each round it is group rank 0 of, on its latest port (node-agent);
    # False: one store for every round, on its join's port (torchrun's plugin, an older agent).
    store_per_round: bool = False
    # What starts its workers: "node-agent", or "torchrun" (the plugin in torch's agent); "": an older client.
    # One job runs one (their rounds' stores and workers' rendezvous differ): an open job refuses the other.
    launcher: Literal["", "node-agent", "torchrun"] = ""
    config: JobConfig = msgspec.field(default_factory=JobConfig)
    instance: ShortText = ""           # random per agent process: tells a restarted agent from a duplicate
    role: Annotated[str, Meta(min_length=1, max_length=64)] = "default"
    host: ShortText = ""               # host name, for operators and failure summaries
    # where this node's agent answers the others' "are you there?" as their witness (0: none)
    witness_port: Port = msgspec.field(default=0, name="probe_port")
    # Fingerprint of this node's script and arguments ("": not checked); an open job refuses another (config_conflict).
    command: Annotated[str, Meta(max_length=MAX_COMMAND)] = ""
    # What the node checks of itself, for operators ("GPU check skipped: ..." where NVML is missing on a
    # GPU node: never silently healthy); "": nothing to say (a CPU node, or an older agent).
    checks: ShortText = ""
    # Its workers can start at once. False while its warm interpreter still imports (it says so on a poll once
    # ready, within MAX_PREPARE_S): the node waits outside the rounds meanwhile, so running nodes never stand
    # stopped for it.
    ready: bool = True
    # Its failure domain (a rack, a switch: what fails together), for choosing where its copies go; "": its host.
    domain: ShortText = ""
    # Where its agent takes peer copies (node_agent/copies/peers.py): its witness port, or a TLS listener of its own
    # where it has a certificate; 0: it takes none (an older agent, or the server uses TLS and it has no certificate).
    copy_port: Port = 0
    # True: its agent checks the keys of the copies it holds against verifiers (CopySource.verifier); False (an
    # older agent, which checks them against its sources' tokens): it takes no part in copies, as one with no
    # copy_port (a node that once held another's copies must not keep a key that acts for it).
    copy_verifiers: bool = False
    # The secret its node's previous agent was given (kept in the node's memory directory): a new instance proves it
    # succeeds that agent, and takes the node's place at once where its record still looks alive (after the
    # server's outage, or before the old agent's end is noticed); "": none (a new host under the id: a lease's wait).
    predecessor: Annotated[str, Meta(max_length=MAX_CREDENTIAL)] = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        printable(addr=self.addr, host=self.host, role=self.role, instance=self.instance, checks=self.checks,
                   domain=self.domain)


class PollRequest(_Request, kw_only=True):
    """Long-poll: answered once this node's view differs from `known_round` (the round whose workers the agent
    runs, -1: none), else after `wait_s`; renews the lease. `master_port` refreshes the port for the next round."""
    known_round: RoundRef = -1
    wait_s: Annotated[float, Meta(ge=0, le=MAX_POLL_WAIT_S)] = 2.0
    master_port: Port = 0
    progress: ProgressNote | None = None
    ready: bool = True                 # as JoinRequest.ready: its workers can start at once
    copies: CopiesNote | None = None
    checks_passed: bool = False        # its node checks passed since the server asked (NodeStatus.checks_due)
    holding: bool = False              # its ranks hold at their next snapshot (NodeStatus.hold_at_snapshot)


class FailureReason(str, enum.Enum):
    """Why a worker failed (the wire keeps a plain string: another is shown as it came, "other" in metrics)."""
    EXITED = "exited"                # exited non-zero, or killed by a signal
    EXITED_EARLY = "exited early"    # exited 0 while its peers went on
    HANG = "hang"                    # the server decided a hang with it as culprit (it did not exit)
    SPAWN_FAILED = "spawn failed"
    STORE_EXITED = "store exited"    # the round's c10d store host died under its workers
    FENCED = "fenced"                # stopped by its agent cut off from the server
    DIVERGED = "diverged"            # its replicated tensors differ from its replicas' (rdzv_server/core/divergence.py)


class WorkerFailure(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """One failed worker, as the agent saw it."""
    local_rank: Annotated[int, Meta(ge=0, le=MAX_LOCAL_WORLD_SIZE)]
    rank: Rank
    exitcode: Annotated[int, Meta(ge=-(2 ** 31), le=2 ** 31)]   # negative: killed by signal -exitcode
    signal: ShortText = ""             # e.g. "SIGSEGV" when killed by a signal
    reason: ShortText = FailureReason.EXITED.value    # a FailureReason's value
    message: Annotated[str, Meta(max_length=MAX_MESSAGE)] = ""   # from the worker's error file
    traceback: Annotated[str, Meta(max_length=MAX_TRACEBACK)] = ""
    timestamp: UnixTime = 0.0          # unix time the failure was seen
    host: ShortText = ""
    node_id: ShortText = ""
    # It ended before it began torch.distributed's process group: no peer's loss broke it (False: or not known)
    before_group: bool = False

    def __post_init__(self) -> None:
        printable(signal=self.signal, reason=self.reason, host=self.host, node_id=self.node_id)


class FailureReport(_Request, kw_only=True):
    round_id: RoundRef
    failures: Annotated[list[WorkerFailure], Meta(min_length=1, max_length=MAX_LOCAL_WORLD_SIZE)]
    progress: ProgressNote | None = None   # the round's last steps here, read as the failure was seen


class SuccessReport(_Request, kw_only=True):
    round_id: RoundRef
    progress: ProgressNote | None = None


class StallReport(_Request, kw_only=True):
    """This node's ranks stopped stepping: what each is doing. The server, which hears every node, decides whether
    the job hangs (rdzv_server/core/hangs.py); the agent sends it again while the stall lasts."""
    round_id: RoundRef
    threshold_s: PositiveSeconds       # the stall threshold the agent used: a report is fresh for 4x that
    ranks: Annotated[list[RankSeen], Meta(min_length=1, max_length=MAX_LOCAL_WORLD_SIZE)]


class UnhealthyKind(str, enum.Enum):
    """Why a node left as unhealthy (LeaveRequest.unhealthy): a kind, so metrics can count by it."""
    GPU = "gpu"                      # NVML found a fault on a GPU its workers use
    HEALTH_CHECK = "health_check"    # the site's --health-check failed
    GPU_FAULT = "gpu_fault"          # a worker's error named a GPU fault (ECC, fallen off the bus, Xid)
    STUCK_WORKER = "stuck_worker"    # a worker outlived SIGKILL (uninterruptible sleep)


class LeaveRequest(_Request, kw_only=True):
    reason: Annotated[str, Meta(max_length=MAX_REASON)] = "left"
    # Set when the node leaves because it is unhealthy: the server keeps its host out of every job for a
    # while. Absent from older agents (a plain leave); ignored by older servers.
    unhealthy: UnhealthyKind | None = None
    # Set when the agent was stopped from outside (a signal: `systemctl restart`, a container stopped): it may be
    # started again under its own id at once, so a job that would lose state only it holds waits for it
    # (rdzv_server/core/awaiting.py). Absent from older agents; ignored by older servers.
    stopped: bool = False
    # With `stopped`: how long its workers may still take to stop (its --stop-timeout: a script that saves a
    # checkpoint on SIGTERM); the wait for its next agent counts from then. Absent from older agents: 0.
    stop_timeout_s: Annotated[float, Meta(ge=0, le=MAX_STOP_S)] = 0.0
    # Sent again, once, by a stopped agent whose place the job keeps, after its workers stopped and its last copies
    # went: its stop is over, and the wait for its next agent counts from now if sooner (rdzv_server/core/stops.py;
    # proven with the credential its leave carried). Absent from older agents; an older server takes it as a leave
    # of a node it no longer knows, and changes nothing.
    stop_ended: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        printable(reason=self.reason)


# Every request an agent sends, by type (protocol.codec.REQUEST_TYPES names their routes).
AgentRequest = JoinRequest | PollRequest | FailureReport | SuccessReport | LeaveRequest | StallReport


class Witness(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """Another member's agent, to ask "are you there?" (a TCP connect) while the server is silent."""
    addr: str
    port: int


class CopySource(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """A node whose snapshot copies this node holds, what the key its copies come with is checked against
    (`verifier`: protocol.tokens.copy_verifier of the node's token; an older server sent the token itself), and its
    local ranks (a holder takes copies of those only; 0: not said, by an older server)."""
    node_id: str
    token: str = ""
    verifier: Annotated[str, Meta(max_length=128)] = ""
    ranks: Annotated[int, Meta(ge=0, le=MAX_LOCAL_WORLD_SIZE)] = 0


class Assignment(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """What one node runs in one round. The same round id means the same world for every member."""
    round_id: int
    group_rank: int
    group_world_size: int
    rank_offset: int                   # global rank of this node's local rank 0
    world_size: int                    # sum of all members' local world sizes
    local_world_size: int
    master_addr: str
    master_port: int
    restart_count: int                 # job-wide, the same on every node
    max_restarts: int
    role_rank_offset: int = 0
    role_world_size: int = 0
    # Up to two other members' agents: reachable while the server is not means the server (or this
    # node's link to it) is what broke, not this node's network: its workers keep running.
    witnesses: tuple[Witness, ...] = ()
    # Peer copies (JobConfig.replicas): the members' agents to push this node's snapshots to, with this node's own
    # token (`copy_token`: a holder takes a node's copies only with that node's token); the nodes whose copies this
    # node holds, with theirs (`copy_sources`). A node that took a gone node's place fetches that node's copies
    # (`copies_of`, with `copies_token`) from `copies_at` as its workers start; `copies_of` is the node itself when
    # it is back at its own place as a new incarnation (its agent restarted): its memory may be gone.
    replicas: tuple[Witness, ...] = ()
    copy_token: str = ""
    copy_sources: tuple[CopySource, ...] = ()
    copies_of: str = ""
    copies_token: str = ""
    copies_at: Witness | None = None
    copies_also: Witness | None = None   # where `copies_at` is that node itself: its peer copies' holder, if any
    # The job's run ("": not said): a finished job's id starts a new run. A node's memory kept across its agent's
    # restart is taken up only within the run that made it (node_agent/workers/memory.py).
    run: ShortText = ""
    # After replicas diverged: the newest step all held alike. The agent drops its ranks' snapshots newer than
    # it before the workers start, so they resume from it (-1: keep them all).
    resume_at_most: Annotated[int, Meta(ge=-1, le=MAX_ROUND)] = -1
    # The job's ranks are replicas of each other (DDP: their snapshots' digests agreed): a node whose ranks move
    # keeps its snapshots (any rank's is every rank's state), where it would empty its directories of a shard.
    ranks_alike: bool = False
    # The gone nodes whose copies a node may still fetch (awaiting.copies_wanted): a holder drops those it holds of
    # any other node that is no source of it now, and frees their room (None: an older server: nothing dropped).
    copies_wanted: Annotated[tuple[ShortText, ...], Meta(max_length=MAX_NODES)] | None = None
    # The newest snapshot step the round's members had noted as it formed (-1: none, or an older server): a holder
    # takes pushes up to it though its own ranks never stepped (a newcomer), and only the server can raise it.
    noted_step: Annotated[int, Meta(ge=-1, le=MAX_ROUND)] = -1
    # Of `copies_wanted`, the live members whose copies go to another holder now (moving_copies.py): a holder keeps
    # theirs while room allows, but drops them to make room for its sources' pushes (node_agent/copies/room.py).
    copies_moving: Annotated[tuple[ShortText, ...], Meta(max_length=MAX_NODES)] = ()
    # Of `copies_wanted`, the gone nodes this round's members are told to fetch (not those of earlier rounds, kept
    # for a fetch not ended): a taker fetches the copies before the newest only where another is among them (their
    # newest may be a snapshot apart). None: an older server (copies_wanted is read instead).
    copies_fetched: Annotated[tuple[ShortText, ...], Meta(max_length=MAX_NODES)] | None = None


class NodeStatus(msgspec.Struct, kw_only=True, gc=False):
    """The server's reply to every agent request: where this node and its job stand now."""
    job_id: str
    job_state: JobState
    node_state: NodeState
    round_id: int                      # the job's current round (-1: none yet)
    restart_count: int
    assignment: Assignment | None = None   # set when node_state is member
    accepted: bool = True              # False: the request was stale (old round) and was not obeyed
    reason: str = ""                   # why things stand as they do (last decision, or why not accepted)
    spare_position: int = -1           # 0-based place in the spare queue
    excluded_for_s: float = 0.0        # cooldown left when excluded
    root_cause: WorkerFailure | None = None  # once FAILED: first failure in time of the round that failed last
    lease_timeout_s: float = 5.0
    credential: str = ""               # only in the reply to a join that created this node's record
    # The longest the server holds this node's polls now (0: an older server that does not say): an
    # answer not come by then (plus a margin) is overdue, and the client checks the path.
    poll_hold_s: float = 0.0
    # In the reply to a stall report: the job's stalled ranks as the server sees them across nodes, one line
    # ("rank 0 alone for 42s at ...; ranks 1-3 waiting in all_reduce"); "": nothing to say.
    stall: Annotated[str, Meta(max_length=MAX_MESSAGE)] = ""
    # A suspect node (rdzv_server/core/suspects.py) takes no place until its agent's node checks pass again:
    # the agent runs them and says so on a poll (PollRequest.checks_passed).
    checks_due: bool = False
    # A suspect of the job is swapped for a spare at the job's next snapshot (rdzv_server/core/swaps.py): this
    # member's ranks wait after their next one (node_agent/training/snapshot.py: hold_after), so none is redone.
    hold_at_snapshot: bool = False
    # The oldest of the round's members' newest peer copies (rdzv_server/core/rounds.copies_floor; -1: none): a
    # member lost now is taken over from a copy no older, so each member's ranks keep their snapshots from this
    # step on besides their keep rule (node_agent/training/snapshot.py: KEEP_FROM), within the memory limit.
    copies_floor: int = -1
    # The oldest of the round's members' newest snapshots (rdzv_server/core/floors.held_floor; -1: none): each
    # member's ranks keep this step and the newest snapshot their keep rule lets go where it is of this step or
    # later, so a failure while a slower rank still writes (or after its last write failed) finds a step every
    # rank holds.
    held_floor: int = -1
    # A round that a member's leave ended, not a failure (-1: none): its members let their ranks' snapshot writes
    # under way end before they stop them (node_agent/workers/writes.py), as the leaving agent does its own.
    writes_end_round: int = -1
    # A node gone from the job whose place the job, waiting, keeps for its next agent: how much longer (awaited,
    # rdzv_server/core/awaiting.py: to the wait's end; below min_nodes: to the join timeout; 0: the job goes on
    # without it). In the reply to a stopped agent's leave: its agent keeps its snapshots for the next one.
    place_kept_s: float = 0.0
    # While the job waits: the nodes of its last round gone since whose copies this node held there, each with the
    # newest step its own last note told. A holder takes that node's last push up to it though its own ranks never got
    # there (a newcomer): a lone holder's leave sends what it told (a review: step 0, as the round's note lagged).
    sources_noted: Annotated[tuple[SourceStep, ...], Meta(max_length=MAX_NODES)] = ()
    # Of the round's copies_moving whose old copy this node holds, those whose own note says their copy landed at a
    # holder of this round: only theirs make room here for a source's push (before, theirs here is their only one).
    moved_landed: Annotated[tuple[ShortText, ...], Meta(max_length=MAX_NODES)] = ()


def poll_ready(status: NodeStatus, known_round: int, holding: bool = False) -> bool:
    """Whether a poll that knows `known_round` (and `holding`) is answered with `status` now, rather than held: the
    job ended, the node is gone, a member's round is not the one it knows or its hold changed, or a node outside
    the round knows one (-1: none yet). The one rule for the server's holds and its subscribers' news
    (rdzv_server/delivery/)."""
    if status.job_state.finished or status.node_state == NodeState.GONE:
        return True
    if status.node_state == NodeState.MEMBER:
        return status.round_id != known_round or status.hold_at_snapshot != holding
    return known_round != -1


class ErrorReply(msgspec.Struct, kw_only=True):
    code: str
    message: str
