"""What each worker of a round is started with: `WorkerLaunch`, from the assignment, options and environment.
Log layout (torchrun's): RUN/attempt_RESTART/{LOCAL_RANK/{stdout,stderr}.log, LOCAL_RANK/error.json,
filtered_*.log, store/}; the probes' records and stacks are not there but in /dev/shm (probes.ProbeRoot). RUN =
LOG_DIR/JOB_XXXXXXXX is new per agent run, so two runs of one id never share files. A new round with the same
restart count writes on in the same directory.
"""
from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from string import Template

from node_agent.settings import Std, WorkerSettings
from node_agent.workers.environment import common_env, worker_argv, worker_env
from node_agent.workers.probes import ProbeFiles, ProbeRoot
from node_agent.workers.warm.store_host import SCRIPT as STORE_HOST
from protocol.messages import Assignment

STORE_RANK = -1     # the local rank and rank of the store host's launch: not a worker


@dataclass(frozen=True)
class WorkerLaunch:
    local_rank: int
    rank: int
    argv: list[str]
    env: dict[str, str]
    log_dir: str | None          # this rank's directory: stdout.log / stderr.log when redirected or tee'd
    redirect: Std = Std.NONE     # streams that go to the log file only
    tee: Std = Std.NONE          # streams that go to the log file and the console
    echo: bool = True            # False: kept off the console (--local-ranks-filter)
    prefix: str = ""             # console prefix of tee'd lines, e.g. "[default0]:"
    prefix_all: bool = False     # the prefix goes on every console line, tee'd or not (--log-line-prefix)
    dup_stdout: tuple[str, ...] = ()   # tee'd lines holding any of these also go to filtered_stdout.log
    dup_stderr: tuple[str, ...] = ()
    attempt_dir: str | None = None     # where filtered_*.log go
    stdin_tty: bool = False      # the worker reads the agent's terminal (breakpoint() works)
    probe: ProbeFiles | None = None   # its progress probe's record and stacks (None: no probe, --no-python)
    cpu_affinity: frozenset[int] | None = None   # --numa-binding: the CPUs it runs on (None: unbound)

    @property
    def error_file(self) -> str | None:
        """Where the worker writes its error (torch's @record), when it has a place for one."""
        return self.env.get("TORCHELASTIC_ERROR_FILE") or None


def store_launch(a: Assignment, python: str, *, run_dir: str, environ: Mapping[str, str] = os.environ) -> WorkerLaunch:
    """The round's c10d store host on the group-rank-0 node, started like a worker; output in RUN_DIR/store/attempt_N/
    (not beside the ranks' directories in attempt_N/, which tools read as local ranks, as torchrun lays them out)."""
    log_dir = attempt_dir(os.path.join(run_dir, "store"), a.restart_count)
    os.makedirs(log_dir, exist_ok=True)
    env = {**common_env(environ, a.local_world_size), "MASTER_ADDR": a.master_addr, "MASTER_PORT": str(a.master_port)}
    return WorkerLaunch(local_rank=STORE_RANK, rank=STORE_RANK, argv=[python, "-u", STORE_HOST, str(a.master_port)],
                        env=env, log_dir=log_dir, redirect=Std.ALL)


def make_run_dir(root: str, job_id: str) -> str:
    """ROOT/JOB_XXXXXXXX, new for this run (torchrun's `<log_dir>/<run_id>_<random>`)."""
    os.makedirs(root, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9_.:@+=~-]", "_", job_id)[:200]   # one path component, never too long
    return tempfile.mkdtemp(prefix=f"{name}_", dir=root)


def attempt_dir(run_dir: str, restart_count: int) -> str:
    return os.path.join(run_dir, f"attempt_{restart_count}")


def build_launches(a: Assignment, opts: WorkerSettings, *, run_dir: str, hostname: str, stdin_tty: bool = False,
                   environ: Mapping[str, str] = os.environ, memory_dirs: Mapping[int, str] | None = None,
                   memory_limit: int | None = None, agent_store: bool = False,
                   cpu_affinity: Mapping[int, frozenset[int]] | None = None,
                   probes: ProbeRoot | None = None) -> list[WorkerLaunch]:
    """One launch per local rank, its directory made under `run_dir`; its probe's files in `probes`."""
    argv = worker_argv(opts, environ)
    base = attempt_dir(run_dir, a.restart_count)
    launches = []
    for local_rank in range(a.local_world_size):
        rank_dir = os.path.join(base, str(local_rank))
        os.makedirs(rank_dir, exist_ok=True)
        rank = a.rank_offset + local_rank
        probe = None if opts.no_python or probes is None else probes.files(local_rank)
        if probe is not None:
            probe.create()          # a fresh record: a new round in the same attempt starts from nothing
        template = opts.log_line_prefix if opts.log_line_prefix is not None else opts.tee_prefix
        prefix = Template(template).safe_substitute(role_name=opts.role, rank=rank, local_rank=local_rank,
                                                    host=hostname)
        launches.append(WorkerLaunch(
            local_rank=local_rank, rank=rank,
            # torchrun's macro: ${local_rank} in the arguments becomes the worker's local rank
            argv=[argv[0], *(Template(arg).safe_substitute(local_rank=str(local_rank)) for arg in argv[1:])],
            env=worker_env(base=environ, assignment=a, local_rank=local_rank, job_id=opts.job_id, role=opts.role,
                           error_file=os.path.join(rank_dir, "error.json"),
                           virtual_local_rank=opts.virtual_local_rank, signals=opts.signals,
                           memory_dir=(memory_dirs or {}).get(local_rank), memory_limit=memory_limit,
                           agent_store=agent_store, probe=probe),
            log_dir=rank_dir, redirect=opts.redirects.for_rank(local_rank), tee=opts.tee.for_rank(local_rank),
            echo=opts.local_ranks_filter is None or local_rank in opts.local_ranks_filter,
            prefix=prefix, prefix_all=opts.log_line_prefix is not None,
            dup_stdout=opts.dup_stdout, dup_stderr=opts.dup_stderr, attempt_dir=base, stdin_tty=stdin_tty,
            probe=probe, cpu_affinity=(cpu_affinity or {}).get(local_rank)))
    # torchrun opens attempt_N/filtered_*.log whenever its filter is given, matched or not: a tool that reads it
    # finds it. Appended to (not emptied), as the lines are: a new round of one restart count writes on.
    for stream, needles in (("stdout", opts.dup_stdout), ("stderr", opts.dup_stderr)):
        if needles:
            open(os.path.join(base, f"filtered_{stream}.log"), "a").close()
    return launches
