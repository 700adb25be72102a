"""The operator views' documents, typed: what `GET /v1/status`, `/v1/jobs/{id}` and `/v1/jobs/{id}/events`
send as JSON. The server builds them (rdzv_server/web/views.py), its status page and `rdzv-ctl` read them
as attributes: a field added here reaches every reader. Times are ISO 8601 UTC, durations seconds."""
from __future__ import annotations

from typing import Any

import msgspec

from protocol.messages import JobConfig, WorkerFailure
from protocol.notes import CopiesNote
from protocol.restarts import RestartAnatomy

NODE_LIMIT_MAX = 2000        # nodes per list of GET /v1/jobs/{id} at most (?node_limit=)


class NodeView(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A node in one of a job's lists; the fields after `checks` only in the lists they describe."""
    node_id: str
    state: str
    host: str
    addr: str
    role: str
    local_world_size: int
    lease_age_s: float
    joined_at: str | None
    recent_failures: int
    checks: str
    group_rank: int | None = None          # members
    rank_offset: int | None = None
    worker_state: str | None = None        # running, succeeded or stopped
    spare_position: int | None = None      # spares
    preparing_for_s: float | None = None   # waiting and spares: not ready yet (its warm interpreter importing)
    excluded_for_s: float | None = None    # excluded
    exclusions: int | None = None
    slow: bool | None = None               # members of an unfinished job: named slow now (the others wait on it)
    steps_per_s: float | None = None       # ... and its steps per second lately (None: not reported)
    copies: CopiesNote | None = None       # its peer copies as its agent last said (issue 46)
    # ... said before the server last restarted, and no note since: old figures, not where the node is now
    copies_before_restart: bool | None = None
    suspicions: int | None = None          # times it was a suspect, within the exclude window of the latest
    checks_due: bool | None = None         # a suspect taking no place until its agent's checks pass again


class DrainedView(msgspec.Struct):
    node_id: str
    reason: str


class NodeCounts(msgspec.Struct):
    """The full length of each node list (a list in a document may show only part of it)."""
    nodes: int
    waiting: int
    spares: int
    excluded: int
    drained: int


class RestartCostView(msgspec.Struct, kw_only=True):
    """One restart since the job first stepped: the round that steps again after it, and what it cost."""
    round_id: int
    cause: str                   # what ended the round before it (a round cause: failure, hang, node_lost, ...)
    cost_s: float | None         # the last step before it to the first step after it (None: under way)
    redone: int | None           # steps done again after a restore (None: unknown)
    anatomy: RestartAnatomy | None = None    # where its time went on the node that stepped again last
    anatomy_node: str | None = None

    @property
    def round_label(self) -> str:
        """How a table names its round: "#next" while it has yet to form (round_id -1: the job waits for nodes)."""
        return f"#{self.round_id}" if self.round_id >= 0 else "#next"


class ProgressView(msgspec.Struct, kw_only=True):
    """A job's training progress as its agents report it. `signal` False: it never stepped (a reader says "no
    progress signal", never 0 steps/s); the defaults are what a server without progress sends."""
    signal: bool = False                     # the job stepped at least once
    steps: int = 0                           # steps taken, every round together
    steps_per_s: float = 0.0                 # the median member's pace lately (0 while no round steps or ended)
    ettr: float | None = None                # effective training time ratio, 0..1 (None: never stepped)
    first_step_at: str | None = None         # the job's first step, any round
    last_step_at: str | None = None          # its latest step
    lost_s: float = 0.0                      # time lost to restarts done (the one under way: restarting_for_s)
    restarts: int = 0                        # restarts done (the job stepped again after each)
    redone: int = 0                          # steps done again after restores, where known
    restarting_for_s: float | None = None    # a restart under way: seconds since the last step before it
    slow_nodes: list[str] = msgspec.field(default_factory=list)      # members named slow now
    # Ranks that stopped stepping, as the server sees them now, not a hang (yet): "rank 0 alone for 42s at
    # train.py:50 in evaluate; ranks 1-3 waiting in all_reduce" (None: none)
    stall: str | None = None
    stall_kind: str | None = None            # alone (a rank at work while the others wait) or moving
    costs: list[RestartCostView] = msgspec.field(default_factory=list)   # the latest restarts, oldest first
    alike_step: int | None = None            # the newest snapshot step every replica held alike (None: not compared)


class JobView(msgspec.Struct, kw_only=True):
    """A job as the status lists it: its head, its counts and (part of) each node list."""
    job_id: str
    state: str
    reason: str
    round_id: int | None
    min_nodes: int
    max_nodes: int
    world_size: int
    group_world_size: int
    restart_count: int
    max_restarts: int
    created_at: str | None
    finished_at: str | None
    counts: NodeCounts
    nodes: list[NodeView]
    waiting: list[NodeView]
    spares: list[NodeView]
    excluded: list[NodeView]
    drained: list[DrainedView]
    lists_cut: bool
    progress: ProgressView = msgspec.field(default_factory=ProgressView)
    copies_off: str = ""               # why the job makes no peer copies, and what to change ("": it makes some)

    def pace(self) -> float | None:
        """The steps per second its readers show: None (a dash) when it never stepped or has ended. No signal, or a
        job that is done, is not one stepping at 0 steps/s."""
        return self.progress.steps_per_s if self.progress.signal and self.finished_at is None else None


class JobDetail(JobView, kw_only=True):
    """One job in full: `GET /v1/jobs/{id}` (one page of each node list)."""
    node_offset: int
    node_limit: int
    config: JobConfig
    last_failure: WorkerFailure | None
    root_cause: WorkerFailure | None
    last_call_ends_in_s: float | None
    rate: list[tuple[str, float]] = msgspec.field(default_factory=list)   # (time, steps per second), oldest first


class HostHold(msgspec.Struct):
    """A host kept out of every job after its node left unhealthy."""
    host: str
    kind: str
    reason: str
    job_id: str
    node_id: str
    held_for_s: float


class StatusView(msgspec.Struct, kw_only=True):
    """`GET /v1/status`: one page of jobs; `total` and `job_states` count every job."""
    time: str | None
    total: int
    offset: int
    limit: int
    next_offset: int | None
    job_states: dict[str, int]
    list_limit: int
    jobs: list[JobView]
    unhealthy_hosts: list[HostHold]


class EventView(msgspec.Struct, kw_only=True, omit_defaults=True):
    seq: int
    time: str | None
    kind: str
    message: str
    node_id: str | None
    round_id: int | None
    data: dict[str, Any] | None = None


class EventsView(msgspec.Struct, kw_only=True):
    """`GET /v1/jobs/{id}/events`: the kept events, oldest first; `more`: newer ones follow."""
    job_id: str
    last_seq: int
    more: bool
    events: list[EventView]


to_json = msgspec.json.Encoder().encode
