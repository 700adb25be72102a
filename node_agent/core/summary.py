"""How a worker failure and a finished job read on every node's console (the policy's exit message)."""
from __future__ import annotations

from protocol.messages import JobState, NodeStatus, WorkerFailure


def how(f: WorkerFailure) -> str:
    return f"signal {f.signal}" if f.signal else f"exit code {f.exitcode}"


def failure_summary(status: NodeStatus) -> str:
    """The job's end on every node's console: why it failed and the first failure in time."""
    lines = [f"job {status.job_id} failed: {status.reason}"]
    rc = status.root_cause
    if rc is not None:
        lines.append("root cause (first failure in time across all nodes):")
        lines.append(f"  host      : {rc.host} (node {rc.node_id})")
        lines.append(f"  rank      : {rc.rank} (local rank {rc.local_rank})")
        lines.append(f"  failure   : {rc.reason}, {how(rc)}")
        if rc.message:
            lines.append(f"  error     : {rc.message}")
        if rc.traceback:
            lines.append("  traceback :")
            lines.extend("    " + ln for ln in rc.traceback.rstrip().splitlines())
    return "\n".join(lines)


def job_ending(status: NodeStatus, ran: bool) -> tuple[int, str, str]:
    """A finished job's end on this node: its exit code, why its workers stop, what it says. A node never exits 0
    for a job its workers did not run."""
    stop = f"job {status.job_state.value}"
    if status.job_state == JobState.SUCCEEDED and not ran:   # a spare, say: nothing ran here
        return 1, stop, f"job {status.job_id} succeeded without this node: its workers never ran ({status.reason})"
    if status.job_state == JobState.SUCCEEDED:
        return 0, stop, f"job {status.job_id} succeeded: {status.reason}"
    if status.job_state == JobState.FAILED:
        return 1, stop, failure_summary(status)
    return 1, stop, f"job {status.job_id} {status.job_state.value}: {status.reason}"
