"""The notes a node's requests carry besides the request itself (PollRequest, FailureReport, SuccessReport): what
its workers did in the round they run (ProgressNote: steps, pace, a restart's anatomy, snapshot digests, a hold)
and where its peer copies stand (CopiesNote). The wire's rules are messages.py's."""
from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from protocol.bounds import MAX_LOCAL_WORLD_SIZE, MAX_ROUND, Bytes, Count, Rank, RoundRef, Seconds, ShortText, UnixTime
from protocol.restarts import RestartAnatomy

# A note's window closes once it holds this many steps, or this long has passed: fewer steps say nothing of a
# node's pace (an eval, a checkpoint write), and a node that stopped stepping shows 0 steps/s within it.
PACE_MIN_STEPS = 5
PACE_MAX_WINDOW_S = 30.0


class RankDigest(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """A rank's newest snapshot: its step and a digest of the tensors every replica holds alike."""
    rank: Rank
    step: Annotated[int, Meta(ge=0, le=MAX_ROUND)]
    digest: Annotated[int, Meta(ge=0, le=2**63 - 1)]     # 63 bits: the wire's integers are int64
    group: Rank = 0            # its replicas: the ranks of the same group (DDP: every rank; HSDP: a shard's)


class ProgressNote(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """What this node's workers did in the round they run, as their probes counted: on the requests the agent
    sends anyway. Times are unix times (0: none yet)."""
    round_id: RoundRef
    probes: Annotated[int, Meta(ge=0, le=MAX_LOCAL_WORLD_SIZE)] = 0   # workers whose probe counts steps
    steps: Count = 0                   # the most steps one of its workers took this round
    first_step_at: UnixTime = 0.0
    last_step_at: UnixTime = 0.0
    step_s: Seconds = 0.0              # the median step interval lately (0: not known yet)
    # Of the window it closes (0: none closed): the share of time its workers' main threads ran or waited for a
    # CPU (mean per worker; the rest they waited on the others) and its steps: nobody waits on a slow node.
    window_s: Seconds = 0.0
    window_steps: Count = 0
    demand: Annotated[float, Meta(ge=0, le=1.0)] = 0.0
    # ... and the share of its counted steps' time its ranks waited on the others inside a backward pass or a
    # collective (-1: not measured): what the server compares when every node has it (rdzv_server/core/slow.py)
    waited: Annotated[float, Meta(ge=-1.0, le=1.0)] = -1.0
    resumed_step: Annotated[int, Meta(ge=-1, le=MAX_ROUND)] = -1   # the step node_agent.snapshot resumed from
    anatomy: RestartAnatomy | None = None     # where this round's restart took its time here (once all stepped)
    # The snapshot step its ranks wait after, as NodeStatus.hold_at_snapshot asked (-1: none)
    held_step: Annotated[int, Meta(ge=-1, le=MAX_ROUND)] = -1
    # Its workers' collectives run on an accelerator (NCCL): their host does not wait in them, so `waited` does not
    # see a wait on the GPU (a node slow on its GPU is not named: rdzv_server/core/slow.py)
    on_device: bool = False
    # protect's, under DDP: each rank's newest few (node_agent/training/probe.py's DIGESTS)
    digests: Annotated[list[RankDigest], Meta(max_length=4 * MAX_LOCAL_WORLD_SIZE)] = []


class CopiesNote(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """This node's peer copies (node_agent/copies/peers.py), on its polls: the newest snapshot step all its local ranks
    hold, the newest step copied to a peer for all of them and where, and its totals (-1: none)."""
    local_step: Annotated[int, Meta(ge=-1, le=MAX_ROUND)] = -1
    copied_step: Annotated[int, Meta(ge=-1, le=MAX_ROUND)] = -1
    holder: ShortText = ""             # addr:port of the peer holding its newest copies
    sent_bytes: Bytes = 0
    refused: Count = 0                 # pushes a peer refused or could not take
    last_refusal: ShortText = ""       # the latest of them: the peer, and why
    held_bytes: Bytes = 0              # copies this node holds for others
    copying: bool = True               # False: its round makes no copies (off): local_step alone is said


class SourceStep(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """A node gone from the job whose copies the told node held, and the newest snapshot step that node's own last
    note told (NodeStatus.sources_noted): the server's word, not a peer's."""
    node_id: ShortText
    step: Annotated[int, Meta(ge=0, le=MAX_ROUND)]
