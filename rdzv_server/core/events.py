"""Kinds of events in a job's history (past tense), and causes of rounds: the strings every API and log shows."""
from __future__ import annotations

import enum


class EventKind(str, enum.Enum):
    JOB_CREATED = "job_created"
    JOB_REUSED = "job_reused"              # a finished job's id started a new run
    NODE_JOINED = "node_joined"
    NODE_BENCHED = "node_spare"            # admitted as a spare (the job is at max_nodes)
    NODE_PREPARING = "node_preparing"      # not ready for long (its warm interpreter importing): left out of rounds
    NODE_READY = "node_ready"              # ready after it was said to be preparing for long
    NODE_EXCLUDED = "node_excluded"
    NODE_READMITTED = "node_readmitted"    # exclusion over (cooldown ended, or cleared by an operator)
    NOT_EXCLUDED = "node_not_excluded"     # its failures were the script's: another node's workers failed alike
    NODE_LOST = "node_lost"
    NODE_LEFT = "node_left"
    NODE_UNHEALTHY = "node_unhealthy"      # left because its own checks found it unhealthy (a broken GPU, ...)
    NODE_DRAINED = "node_drained"
    NODE_UNDRAINED = "node_undrained"
    NODE_SUCCEEDED = "node_succeeded"
    WORKER_FAILED = "worker_failed"
    ROUND_OPENED = "round_opened"          # the first node is waiting for the next round
    ROUND_COMPLETED = "round_completed"
    ROUND_ABANDONED = "round_waiting"      # below min_nodes after a change: back to collecting nodes
    JOB_RESIZED = "job_resized"
    JOB_SUCCEEDED = "job_succeeded"
    JOB_FAILED = "job_failed"
    JOB_CLOSED = "job_closed"
    SERVER_RESTARTED = "server_restarted"
    LEASES_EXTENDED = "leases_extended"    # the server heard from no agent for a while: its fault, not theirs
    MASTER_ADDR_CORRECTED = "master_addr_corrected"   # rank 0 advertised loopback on a multi-host round
    HANG_DETECTED = "hang_detected"        # ranks waited on one that stalled: the round fails, that rank the cause
    RANKS_ALONE = "ranks_alone"            # a rank works alone while the others wait: shown, not (yet) a hang
    LONG_COLLECTIVE = "long_collective"    # every rank waits while data still moves: shown, not (yet) a hang
    HANG_EXCUSED = "hang_excused"          # alone again where a limit decided a hang before: not decided again
    NODE_SLOW = "node_slow"                # the other nodes wait on it (core/slow.py)
    NODE_PACE_OK = "node_pace_ok"          # no longer slow
    PACE_UNSEEN = "pace_unseen"            # slow nodes are to be swapped, but the job's collectives run on GPUs
    NODE_SUSPECT = "node_suspect"          # a worker asked for other hardware, or its replicas diverged
    REPLICAS_DIVERGED = "replicas_diverged"   # ranks' replicated tensors differ at a step (divergence.py)
    WORK_REDONE = "work_redone"            # a restart resumed from a step before the one the job had reached


class RoundCause(str, enum.Enum):
    """Why a round was formed (the `cause` of round events and of the rounds metric)."""
    START = "start"
    SCALE_UP = "scale_up"
    FAILURE = "failure"
    HANG = "hang"
    DIVERGED = "diverged"          # replicas held different parameters: resumed from the newest agreed step
    NODE_LOST = "node_lost"
    NODE_LEFT = "node_left"
    NODE_UNHEALTHY = "node_unhealthy"
    NODE_DRAINED = "node_drained"
    SWAPPED = "swapped"            # a suspect swapped for a spare at a snapshot (swaps.py)
    RESIZED = "resized"


# A node taken out of the job: the event recorded and the cause of the round that follows.
REMOVAL_CAUSE = {
    EventKind.NODE_LOST: RoundCause.NODE_LOST,
    EventKind.NODE_LEFT: RoundCause.NODE_LEFT,
    EventKind.NODE_UNHEALTHY: RoundCause.NODE_UNHEALTHY,
    EventKind.NODE_DRAINED: RoundCause.NODE_DRAINED,
}
