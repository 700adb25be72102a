"""What a worker process is started with: its environment and command line, with torchrun's names and meanings
so scripts run unchanged. On purpose unlike torchrun: TORCHELASTIC_RESTART_COUNT is the server's job-wide count,
the same on every node. The agent's secrets (AGENT_SECRETS) never reach user code or /proc/PID/environ.
"""
from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping, Sequence

import node_agent.training.probe as probe
from node_agent.settings import DEFAULT_SIGNALS, WorkerSettings
from node_agent.training.probe import ENV as PROBE_VAR
from node_agent.training.snapshot import DIR_VAR as MEMORY_DIR_VAR
from node_agent.training.snapshot import LIMIT_VAR as MEMORY_LIMIT_VAR
from node_agent.workers.probes import ProbeFiles
from protocol.messages import Assignment

# The probe's loader (training/boot/sitecustomize.py): an interpreter with this folder first on its PYTHONPATH has
# the probe before anything runs.
BOOT_DIR = os.path.join(os.path.dirname(os.path.abspath(probe.__file__)), "boot")
# The agent's credentials for the server (and rdzv-ctl's admin token file): never a worker's.
AGENT_SECRETS = ("RDZV_TOKEN", "RDZV_TOKEN_FILE", "RDZV_ADMIN_TOKEN_FILE")
# Set per worker by worker_env; all else is common_env, the same in every worker and what a warm zygote gets.
PER_WORKER_VARS = frozenset({
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "CUDA_VISIBLE_DEVICES",
    "TORCHELASTIC_ERROR_FILE", MEMORY_DIR_VAR, MEMORY_LIMIT_VAR, PROBE_VAR})


def common_env(base: Mapping[str, str], local_world_size: int) -> dict[str, str]:
    """What every worker's environment starts from: `base` less AGENT_SECRETS and an inherited error file,
    with OMP_NUM_THREADS=1 when several workers share the node."""
    env = dict(base)
    # An inherited TORCHELASTIC_ERROR_FILE is the launcher's: workers would overwrite it instead of ours.
    env.pop("TORCHELASTIC_ERROR_FILE", None)
    for name in (*AGENT_SECRETS, MEMORY_DIR_VAR, MEMORY_LIMIT_VAR):   # an outer agent's memory dir is not ours
        env.pop(name, None)
    # Several workers each sizing OpenMP to every core oversubscribe the node; torchrun sets 1.
    if "OMP_NUM_THREADS" not in base and local_world_size > 1:
        env["OMP_NUM_THREADS"] = "1"
    return env


def worker_env(*, base: Mapping[str, str], assignment: Assignment, local_rank: int, job_id: str,
               role: str, error_file: str | None, nccl_async: str | None = None,
               virtual_local_rank: bool = False, signals: Sequence[int] = DEFAULT_SIGNALS,
               memory_dir: str | None = None, memory_limit: int | None = None,
               agent_store: bool = False, probe: ProbeFiles | None = None) -> dict[str, str]:
    """One worker's whole environment: common_env(base) plus the launcher's variables.

    `nccl_async`: TORCH_NCCL_ASYNC_ERROR_HANDLING; None keeps the base's, else "1" (torchrun's: NCCL errors
    abort, not hang). `virtual_local_rank`: LOCAL_RANK 0, CUDA_VISIBLE_DEVICES the rank's own GPU. `signals`:
    TORCHELASTIC_SIGNALS_TO_HANDLE, read by torch's launchers in a worker. `memory_dir`: NODE_AGENT_MEMORY_DIR,
    its limit in bytes NODE_AGENT_MEMORY_LIMIT; None: the first empty, the second unset. `agent_store`: the agent
    hosts the c10d store at MASTER_ADDR:MASTER_PORT (every rank a client), not worker rank 0. `probe`: its progress
    probe's files (NODE_AGENT_PROGRESS; the probe takes it out of the worker's environment). Pure: it makes no file.
    """
    a = assignment
    if not 0 <= local_rank < a.local_world_size:
        raise ValueError(f"local_rank {local_rank} outside 0..{a.local_world_size - 1}")
    env = common_env(base, a.local_world_size)
    env.update({
        "RANK": str(a.rank_offset + local_rank),
        "LOCAL_RANK": str(local_rank),
        "GROUP_RANK": str(a.group_rank),
        "ROLE_RANK": str(a.role_rank_offset + local_rank),
        "ROLE_NAME": role,
        "LOCAL_WORLD_SIZE": str(a.local_world_size),
        "WORLD_SIZE": str(a.world_size),
        "GROUP_WORLD_SIZE": str(a.group_world_size),
        "ROLE_WORLD_SIZE": str(a.role_world_size or a.world_size),   # 0: one role, the whole world
        "MASTER_ADDR": a.master_addr,
        "MASTER_PORT": str(a.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(a.restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(a.max_restarts),
        "TORCHELASTIC_RUN_ID": job_id,
        "TORCHELASTIC_USE_AGENT_STORE": str(agent_store),
        "TORCHELASTIC_SIGNALS_TO_HANDLE": ",".join(signal.Signals(s).name for s in signals),   # SIGTERM,SIGINT
        "TORCH_NCCL_ASYNC_ERROR_HANDLING":
            nccl_async if nccl_async is not None else base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    })
    if virtual_local_rank:
        visible = base.get("CUDA_VISIBLE_DEVICES")
        devices = [d.strip() for d in visible.split(",")] if visible is not None else None
        if devices is not None and local_rank >= len(devices):
            raise ValueError(f"local rank {local_rank} has no GPU in CUDA_VISIBLE_DEVICES={visible!r}")
        env["LOCAL_RANK"] = "0"
        env["CUDA_VISIBLE_DEVICES"] = devices[local_rank] if devices is not None else str(local_rank)
    if error_file is not None:
        env["TORCHELASTIC_ERROR_FILE"] = error_file
    env[MEMORY_DIR_VAR] = memory_dir or ""     # empty: none, and every rank joins protect's one question of it
    if memory_dir is not None and memory_limit is not None:
        env[MEMORY_LIMIT_VAR] = str(memory_limit)
    if probe is not None:
        env[PROBE_VAR] = probe.env()
    return env


# --run-path: torchrun runs the script with runpy.run_path in a fresh interpreter (its spawned worker).
RUN_PATH = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"


def worker_argv(opts: WorkerSettings, environ: Mapping[str, str] = os.environ) -> list[str]:
    """`python -u [-m] script args`, the program itself (--no-python), or the script through runpy (--run-path,
    which wins, as in torchrun). PYTHON_EXEC picks the interpreter, as in torchrun."""
    if opts.run_path:
        return [sys.executable, "-u", "-c", RUN_PATH, opts.script, *opts.script_args]
    if opts.no_python:
        return [opts.script, *opts.script_args]
    python = environ.get("PYTHON_EXEC") or sys.executable
    # -u: unbuffered, so a worker's last lines before a crash reach its log.
    if opts.module:
        return [python, "-u", "-m", opts.script, *opts.script_args]
    return [python, "-u", opts.script, *opts.script_args]


def booted(env: dict[str, str]) -> dict[str, str]:
    """`env` with BOOT_DIR first on PYTHONPATH: the interpreter it starts (a warm zygote) has the probe."""
    path = env.get("PYTHONPATH")
    return {**env, "PYTHONPATH": BOOT_DIR + (os.pathsep + path if path else "")}


def cold_env(env: dict[str, str]) -> dict[str, str]:
    """A cold worker's environment: the probe's boot first on PYTHONPATH (it takes itself off again)."""
    return booted(env) if PROBE_VAR in env else env
