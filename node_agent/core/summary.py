"""How a worker failure and a failed job read on every node's console (the policy's exit message)."""
from __future__ import annotations

from protocol.messages import NodeStatus, WorkerFailure


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
