"""What each part of the agent runs with: one frozen value per consumer. The CLI splits its options into
these (cli/options.py `parse_options`) and main.py hands each part its own, so no part imports from cli/."""
from __future__ import annotations

import enum
import os
import re
import signal
import socket
from dataclasses import dataclass, field

from protocol.messages import JobConfig

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)   # torchrun's
DEFAULT_TEE_PREFIX = "[${role_name}${local_rank}]:"     # torchrun's prefix of tee'd lines
# What a typical training script imports before its first step (its first optimizer step imports torch._dynamo).
DEFAULT_PRELOAD = ("torch", "torch.distributed", "torch.nn", "torch.optim", "torch._dynamo")


def default_node_id(pid: int | None = None) -> str:
    """HOSTNAME-PID (this agent's pid, or `pid`'s), trimmed to the node-id rule (host names may carry characters it
    refuses)."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()).lstrip("._-") or "node"
    suffix = f"-{os.getpid() if pid is None else pid}"
    return host[: 128 - len(suffix)] + suffix


def made_from_pid(node_id: str) -> bool:
    """Whether `node_id` is a default one of this host (HOSTNAME-PID, whatever the pid)."""
    _, _, pid = node_id.rpartition("-")
    return pid.isdigit() and len(pid) <= 10 and node_id == default_node_id(int(pid))


class Mode(str, enum.Enum):
    """Where the rendezvous runs: an rdzv-server, this process (one node), or nowhere (static ranks)."""
    SERVER = "server"
    STANDALONE = "standalone"
    STATIC = "static"


class Std(enum.IntFlag):
    """Which of a worker's standard streams a setting covers (torchrun's numbering)."""
    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


@dataclass(frozen=True)
class StdSpec:
    """A `-r/--redirects` or `-t/--tee` value: one Std for all ranks, or a map (missing ranks: NONE)."""
    default: Std = Std.NONE
    per_rank: tuple[tuple[int, Std], ...] = ()

    def for_rank(self, local_rank: int) -> Std:
        return next((std for rank, std in self.per_rank if rank == local_rank), self.default)


@dataclass(frozen=True)
class WorkerSettings:
    """How the node's workers start, log, stop and are watched (workers/)."""
    script: str
    script_args: tuple[str, ...] = ()
    module: bool = False
    no_python: bool = False
    run_path: bool = False
    nproc: int = 1
    job_id: str = "default"
    node_id: str = ""
    role: str = "default"
    log_dir: str | None = None
    run_dir: str | None = None         # this run's log directory (main.py makes it)
    redirects: StdSpec = StdSpec()
    tee: StdSpec = StdSpec()
    local_ranks_filter: frozenset[int] | None = None   # None: every local rank shows on the console
    dup_stdout: tuple[str, ...] = ()   # --duplicate-stdout-filters
    dup_stderr: tuple[str, ...] = ()
    log_line_prefix: str | None = None  # --log-line-prefix: a template for every console line
    tee_prefix: str = DEFAULT_TEE_PREFIX
    virtual_local_rank: bool = False
    signals: tuple[int, ...] = DEFAULT_SIGNALS
    stop_timeout: float = 30.0         # signal -> SIGKILL
    kill_timeout: float = 10.0         # after SIGKILL: a worker still alive then marks the node unhealthy
    memory_dir_limit: int | None = None   # bytes for the node's in-memory checkpoints; None: the default; 0: off
    copy_bandwidth: int = 1 << 30   # bytes/s of peer copies sent (node_agent/copies/peers.py); 0: no cap
    warm_workers: str = "auto"         # auto: Python entry points fork from a warm zygote; off: all cold
    # --warm-preload: exactly these; None: DEFAULT_PRELOAD and the installed packages the script imports at its top
    # level (workers/warm/eligible.py's script_preloads)
    warm_preload: tuple[str, ...] | None = None

    @property
    def warm(self) -> bool:
        """Workers may start warm: a Python script or module (not --no-python, not --run-path)."""
        return self.warm_workers == "auto" and not self.no_python and not self.run_path


@dataclass(frozen=True)
class LinkSettings:
    """Where the rendezvous is and how this node is known there (the transport, the join)."""
    mode: Mode = Mode.SERVER
    endpoint_host: str | None = None
    endpoint_port: int | None = None
    endpoint_scheme: str = "http"
    endpoint_replicas: tuple[tuple[str, int], ...] = ()
    host_if_unserved: bool = False     # one node at an endpoint on this host: in-process if nothing listens there
    token_file: str | None = None
    token: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None        # this node's certificate and key, for peer copies over TLS (copies/tls.py)
    tls_key: str | None = None
    job_id: str = "default"
    job_id_source: str = ""            # where a job id that was not given came from (said at start)
    command: str = ""                  # the command's fingerprint, sent with joins ("": not checked)
    job: JobConfig = field(default_factory=JobConfig)
    node_id: str = ""
    local_addr: str | None = None
    role: str = "default"
    failure_domain: str = ""           # JoinRequest.domain ("": the host)
    nproc: int = 1
    node_rank: int = 0                 # static mode: this node's rank, node rank 0's address and the store port
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    server_wait: float = 60.0

    @property
    def endpoint(self) -> str | None:
        """`host:port` for URLs, with IPv6 hosts in brackets."""
        if self.endpoint_host is None:
            return None
        host = f"[{self.endpoint_host}]" if ":" in self.endpoint_host else self.endpoint_host
        return f"{host}:{self.endpoint_port}"

    @property
    def server(self) -> str:
        """The rdzv-server as the user named it (HOST:PORT, replicas after a comma); "" without one."""
        if self.mode is not Mode.SERVER:
            return ""
        return ",".join(f"{host}:{port}" for host, port in ((self.endpoint_host, self.endpoint_port),
                                                              *self.endpoint_replicas))


@dataclass(frozen=True)
class CheckSettings:
    """The node's own checks (node_checks.py): GPUs, the site's command, --numa-binding."""
    nproc: int = 1
    numa_binding: str | None = None    # a gpu.topology.BindMode value
    gpu_check: bool = True             # on only where the node has /dev/nvidia*
    gpu_check_interval: float = 5.0
    health_check: str | None = None
    health_check_timeout: float = 30.0


@dataclass(frozen=True)
class AgentSettings:
    workers: WorkerSettings
    link: LinkSettings
    checks: CheckSettings
    reply_file: str | None = None      # the agent's own TORCHELASTIC_ERROR_FILE: the job's root cause goes there
    warnings: tuple[str, ...] = ()
