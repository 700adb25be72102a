"""What each worker of a round is started with: `WorkerLaunch`, built from the server's assignment,
the agent's options and its environment."""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from node_agent.environment import worker_argv, worker_env
from node_agent.option_values import Std
from node_agent.options import AgentOptions
from protocol.messages import Assignment


@dataclass(frozen=True)
class WorkerLaunch:
    local_rank: int
    rank: int
    argv: list[str]
    env: dict[str, str]
    log_dir: str | None          # this rank's directory for stdout.log / stderr.log
    redirect: Std = Std.NONE     # streams that go to the log file only
    tee: Std = Std.NONE          # streams that go to the log file and the console
    echo: bool = True            # False: kept off the console (--local-ranks-filter)
    prefix: str = ""             # e.g. "[host:rank 3]"
    heartbeat: bool = False      # give the worker a heartbeat pipe (NODE_AGENT_HEARTBEAT_FD)

    @property
    def error_file(self) -> str | None:
        """Where the worker writes its error (torch's @record), when it has a place for one."""
        return self.env.get("TORCHELASTIC_ERROR_FILE")


def attempt_dir(root: str, job_id: str, node_id: str, round_id: int) -> str:
    """This node's directory for one round: `ROOT/JOB/NODE/attempt_ROUND`, one sub-directory per local rank."""
    return os.path.join(root, job_id, node_id, f"attempt_{round_id}")


def build_launches(a: Assignment, opts: AgentOptions, *, files_root: str, hostname: str,
                   environ: Mapping[str, str] = os.environ) -> list[WorkerLaunch]:
    """One launch per local rank of the assignment, its directory made.

    Every rank gets a directory under `files_root` for its error file; its stdout/stderr logs go there
    only with --log-dir (then `files_root` is that directory, else a temporary one).
    """
    argv = worker_argv(opts, environ)
    base = attempt_dir(files_root, opts.job_id, opts.node_id, a.round_id)
    launches = []
    for local_rank in range(a.local_world_size):
        rank_dir = os.path.join(base, str(local_rank))
        os.makedirs(rank_dir, exist_ok=True)
        rank = a.rank_offset + local_rank
        launches.append(WorkerLaunch(
            local_rank=local_rank, rank=rank, argv=argv,
            env=worker_env(base=environ, assignment=a, local_rank=local_rank, job_id=opts.job_id, role=opts.role,
                           error_file=os.path.join(rank_dir, "error.json")),
            log_dir=rank_dir if opts.log_dir is not None else None,
            redirect=opts.redirects.for_rank(local_rank), tee=opts.tee.for_rank(local_rank),
            echo=opts.local_ranks_filter is None or local_rank in opts.local_ranks_filter,
            prefix=f"[{hostname}:{rank}]", heartbeat=opts.hang_timeout > 0))
    return launches
