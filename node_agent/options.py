"""The node agent's command line: argparse in, one frozen `AgentOptions` out.

torchrun's spellings are accepted as aliases so an existing launch line keeps working. Every bad input
becomes `OptionsError` with one line naming the flag as the user spelled it; argparse never exits or
prints a traceback (only `--help` exits, with status 0). Values are checked here, once, so the rest of
the agent can trust them. Nothing here imports torch: GPUs are counted from the driver's files.
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
import dataclasses
from dataclasses import dataclass
from typing import Any, NoReturn

import msgspec

from protocol.ids import job_id_problem, node_id_problem
from protocol.tokens import MAX_TOKEN_CHARS, token_problem
from protocol.messages import JobConfig
from node_agent.option_values import (  # noqa: F401  (Std, StdSpec, count_gpus: re-exported)
    DEFAULT_PORT, Fail, Std, StdSpec, _default_node_id, _int, _rank_set, _seconds, _split_j, count_gpus,
    parse_endpoint, parse_nnodes, parse_std, resolve_nproc,
)


class OptionsError(ValueError):
    """A bad command line; the message is one line meant for the user."""


@dataclass(frozen=True)
class AgentOptions:
    script: str
    script_args: tuple[str, ...] = ()
    endpoint_host: str | None = None
    endpoint_port: int | None = None
    endpoint_scheme: str = "http"      # https with --tls-ca or an https:// endpoint
    endpoint_replicas: tuple[tuple[str, int], ...] = ()   # more replicas of the server: --endpoint a:P,b:P
    token_file: str | None = None      # --token-file or $RDZV_TOKEN_FILE: read at start-up (agent_token)
    token: str | None = None           # $RDZV_TOKEN: the token itself
    tls_ca: str | None = None          # CA bundle that must have signed the server's certificate
    nproc: int = 1
    nproc_spec: str = "1"              # as typed ("gpu", "4", ...), for logs
    job_id: str = "default"
    job: JobConfig = JobConfig()       # the job's settings, sent with every join (defaults: JobConfig's)
    node_id: str = ""
    local_addr: str | None = None
    role: str = "default"
    module: bool = False
    no_python: bool = False
    log_dir: str | None = None
    redirects: StdSpec = StdSpec()
    tee: StdSpec = StdSpec()
    local_ranks_filter: frozenset[int] | None = None   # None: every local rank shows on the console
    standalone: bool = False
    stop_timeout: float = 5.0
    server_wait: float = 60.0
    hang_timeout: float = 0.0          # 0: hang detection off
    warnings: tuple[str, ...] = ()

    @property
    def endpoint(self) -> str | None:
        """`host:port` for URLs, with IPv6 hosts in brackets."""
        if self.endpoint_host is None:
            return None
        host = f"[{self.endpoint_host}]" if ":" in self.endpoint_host else self.endpoint_host
        return f"{host}:{self.endpoint_port}"


# ---------------------------------------------------------------------------------------------- parsing


class _Parser(argparse.ArgumentParser):
    # argparse would print usage and sys.exit(2); the CLI decides how to show errors instead.
    def error(self, message: str) -> NoReturn:
        if message.startswith("the following arguments are required"):   # only the script is
            message = "missing the training script: node-agent [options] SCRIPT [ARGS...]"
        raise OptionsError(message)


class _Formatter(argparse.HelpFormatter):
    # List every alias once and the metavar once: "--nproc, --nproc-per-node N" rather than a
    # metavar after each alias, which makes the aliased flags unreadable.
    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings or action.nargs == 0:
            return super()._format_action_invocation(action)
        return f"{', '.join(action.option_strings)} {self._format_args(action, action.dest.upper())}"


class _Spelled(argparse.Action):
    """Store a value and remember which spelling the user typed, so errors name that spelling."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.__dict__.setdefault("_spelling", {})[self.dest] = option_string


# (spellings, dest, metavar, help). A dest that names a JobConfig field is that job setting: its default
# (shown as {default} in the help) and its bounds are JobConfig's; other defaults are AgentOptions'.
# A metavar of None marks an on/off flag.
_FLAGS: list[tuple[tuple[str, ...], str, str | None, str]] = [
    (("--endpoint", "--rdzv-endpoint", "--rdzv_endpoint"), "endpoint", "[https://]HOST:PORT",
     f"rendezvous server address (port defaults to {DEFAULT_PORT}; IPv6 as [::1]:PORT; https:// for TLS); "
     "replicas of one server as a comma-separated list (the agent follows the leader)"),
    (("--token-file", "--token_file"), "token_file", "F",
     "file holding the server's token (or set RDZV_TOKEN_FILE, or RDZV_TOKEN to the token itself)"),
    (("--tls-ca", "--tls_ca"), "tls_ca", "F",
     "CA certificates (PEM) that signed the server's TLS certificate; implies https"),
    (("--nproc", "--nproc-per-node", "--nproc_per_node"), "nproc", "N|gpu|cpu|auto",
     "workers on this node: a number, one per GPU, one per CPU, or auto (GPUs if any, else CPUs); "
     "default 1"),
    (("--nnodes",), "nnodes", "MIN:MAX|N", "number of nodes, or an elastic range; default 1:1"),
    (("-j", "--j"), "j", "[MIN:]NxM", "TorchX shorthand: N nodes (elastic MIN:N) of M workers each"),
    (("--job-id", "--rdzv-id", "--rdzv_id"), "job_id", "ID",
     "job id shared by every node of the job; default {default!r}"),
    (("--max-restarts", "--max_restarts"), "max_restarts", "K",
     "job-wide worker group restarts before the job fails; default {default}"),
    (("--node-id", "--node_id"), "node_id", "ID", "this node's id at the server; default HOSTNAME-PID"),
    (("--local-addr", "--local_addr"), "local_addr", "ADDR",
     "address other nodes reach this node at (MASTER_ADDR when it is group rank 0)"),
    (("--role",), "role", "NAME", "worker role (ROLE_NAME); default {default!r}"),
    (("-m", "--module"), "module", None, "run the script as a module, like python -m"),
    (("--no-python", "--no_python"), "no_python", None, "run the script directly, not with python"),
    (("--log-dir", "--log_dir"), "log_dir", "DIR",
     "directory for per-rank stdout.log/stderr.log and error.json"),
    (("-r", "--redirects"), "redirects", "STD",
     "send worker streams to log files only: 0 none, 1 stdout, 2 stderr, 3 both, or a "
     "per-local-rank map such as 0:1,1:2"),
    (("-t", "--tee"), "tee", "STD",
     "send worker streams to log files and the console (same format as --redirects)"),
    (("--local-ranks-filter", "--local_ranks_filter"), "local_ranks_filter", "R,R,...",
     "show only these local ranks on the console (log files keep everything)"),
    (("--standalone",), "standalone", None,
     "single node: run an embedded rendezvous server, no --endpoint needed"),
    (("--stop-timeout", "--stop_timeout"), "stop_timeout", "S",
     "seconds between SIGTERM and SIGKILL when stopping workers; default {default:g}"),
    (("--last-call", "--last_call"), "last_call_s", "S",
     "seconds an elastic round waits for more nodes once it has MIN; default {default:g}"),
    (("--join-timeout", "--join_timeout"), "join_timeout_s", "S",
     "seconds to wait for a round to form; default {default:g}"),
    (("--lease-timeout", "--lease_timeout"), "lease_timeout_s", "S",
     "seconds of silence after which the server drops a node; default {default:g}"),
    (("--server-wait", "--server_wait"), "server_wait", "S",
     "seconds to keep retrying an unreachable server; default {default:g}"),
    (("--hang-timeout", "--hang_timeout"), "hang_timeout", "S",
     "kill and report a worker that called node_agent.heartbeat.beat() but then stopped for this "
     "long; default {default:g} (off)"),
    (("--exclude-after", "--exclude_after"), "exclude_after", "K",
     "exclude a node after K worker failures within --exclude-window (job-wide); 0 never; default {default}"),
    (("--exclude-window", "--exclude_window"), "exclude_window_s", "S",
     "window for counting a node's failures; default {default:g}"),
    (("--exclude-cooldown", "--exclude_cooldown"), "exclude_cooldown_s", "S",
     "first exclusion's length, doubling each time up to {cooldown_max:g} s; default {default:g}"),
    (("--exclude-lost-after", "--exclude_lost_after"), "exclude_lost_after", "K",
     "keep a node out when it was lost K times within --exclude-window (a flapping host); 0 never; "
     "default {default}"),
    (("--exclude-lost-cooldown", "--exclude_lost_cooldown"), "exclude_lost_cooldown_s", "S",
     "how long such a node is kept out the first time, doubling each time up to {cooldown_max:g} s; "
     "default {default:g}"),
]
_JOB_DEFAULTS: dict[str, Any] = {f.name: f.default for f in msgspec.structs.fields(JobConfig)}
_AGENT_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(AgentOptions)}
_JOB_FLAGS = [dest for _, dest, _, _ in _FLAGS if dest in _JOB_DEFAULTS]   # job settings with a flag
_SPELLING = {dest: flags[0] for flags, dest, _, _ in _FLAGS}


def _help(dest: str, text: str) -> str:
    default = _JOB_DEFAULTS.get(dest, _AGENT_DEFAULTS.get(dest))
    return text.format(default=default, cooldown_max=_JOB_DEFAULTS["exclude_cooldown_max_s"])


_IGNORED = {   # torchrun flags with no meaning here: accepted so launch lines work, then warned about
    "rdzv_backend": ("--rdzv-backend", "--rdzv_backend"),
    "rdzv_conf": ("--rdzv-conf", "--rdzv_conf"),
    "monitor_interval": ("--monitor-interval", "--monitor_interval"),
    "start_method": ("--start-method", "--start_method"),
}


def build_argparser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="node-agent",
        description="Join an elastic training job at a rendezvous server, then run and supervise this "
                    "node's workers (a drop-in replacement for torchrun).",
        allow_abbrev=False,
        formatter_class=_Formatter,
    )
    # Defaults are None so explicit use can be told apart (-j conflicts, --standalone); the real
    # defaults are applied in parse_options.
    for flags, dest, metavar, text in _FLAGS:
        if metavar is None:
            p.add_argument(*flags, dest=dest, action="store_true", help=_help(dest, text))
        else:
            p.add_argument(*flags, dest=dest, action=_Spelled, default=None, metavar=metavar,
                           help=_help(dest, text))
    for dest, flags in _IGNORED.items():
        p.add_argument(*flags, dest=dest, action=_Spelled, default=None, metavar="VALUE",
                       help="accepted for torchrun compatibility; ignored")
    p.add_argument("script", help="training script (or module with -m, or program with --no-python)")
    p.add_argument("script_args", nargs=argparse.REMAINDER,
                   help="everything after the script goes to it untouched")
    return p


def _script_index(parser: argparse.ArgumentParser, argv: list[str]) -> int | None:
    """Index of the script in argv, found the way argparse would, or None to let argparse complain.

    Splitting here rather than trusting nargs=REMAINDER keeps the script's arguments byte for byte:
    argparse drops a `--` that follows the script.
    """
    actions = parser._option_string_actions
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            return i + 1 if i + 1 < len(argv) else None
        if not tok.startswith("-") or tok == "-":
            return i
        action = actions.get(tok.split("=", 1)[0] if tok.startswith("--") else tok[:2])
        if action is None:
            return None
        # "--flag value" and "-j value" use the next token; "--flag=v" and "-j2x4" carry their own
        i += 2 if tok in actions and action.nargs != 0 else 1
    return None


def parse_options(argv: Sequence[str], environ: Mapping[str, str] = os.environ) -> AgentOptions:
    parser = build_argparser()
    args = list(argv)
    at = _script_index(parser, args)
    ns = parser.parse_args(args if at is None else args[: at + 1])
    ns.script_args = [] if at is None else args[at + 1:]
    spelling: dict[str, str] = ns.__dict__.get("_spelling", {})

    def name(dest: str) -> str:
        return spelling.get(dest) or _SPELLING.get(dest) or "--" + dest.replace("_", "-")

    def fail(dest: str, why: str) -> NoReturn:
        raise OptionsError(f"{name(dest)}: {why}")

    def failing(dest: str) -> Fail:
        return lambda why: fail(dest, why)

    warnings = [f"{name(d)} is ignored by node-agent" for d in _IGNORED if getattr(ns, d) is not None]

    if ns.module and ns.no_python:
        raise OptionsError("--no-python cannot be combined with -m/--module")

    # Node and worker counts: -j is shorthand for --nnodes plus --nproc, so both at once is ambiguous.
    nproc_text: str = ns.nproc if ns.nproc is not None else "1"
    nnodes_text: str = ns.nnodes if ns.nnodes is not None else "1:1"
    if ns.j is not None:
        for other in ("nnodes", "nproc"):
            if getattr(ns, other) is not None:
                raise OptionsError(f"{name('j')} conflicts with {name(other)}: give one or the other")
        nnodes_text, nproc_text = _split_j(ns.j, failing("j"))
    min_nodes, max_nodes = parse_nnodes(nnodes_text, failing("j" if ns.j else "nnodes"))
    nproc = resolve_nproc(nproc_text, environ, failing("j" if ns.j else "nproc"))

    host: str | None = None
    port: int | None = None
    replicas: tuple[tuple[str, int], ...] = ()
    endpoint_scheme = "http"
    if ns.standalone:
        if ns.endpoint is not None:
            warnings.append(f"{name('endpoint')} is ignored with --standalone")
        if (min_nodes, max_nodes) != (1, 1):
            warnings.append(f"--standalone runs one node: nnodes {min_nodes}:{max_nodes} becomes 1:1")
        min_nodes = max_nodes = 1
    elif ns.endpoint is None:
        raise OptionsError("--endpoint HOST:PORT is required (or --standalone)")
    else:
        places: list[tuple[str, int]] = []
        for text in (part.strip() for part in ns.endpoint.split(",")):    # replicas: a:29400,b:29400
            scheme, sep, rest = text.partition("://")
            if sep and scheme.lower() not in ("http", "https"):
                fail("endpoint", f"expected http:// or https://, got {scheme + sep!r}")
            scheme = scheme.lower() if sep else ("https" if ns.tls_ca else "http")
            if scheme == "http" and ns.tls_ca:
                fail("tls_ca", f"needs an https endpoint, got {text!r}")
            if places and scheme != endpoint_scheme:
                fail("endpoint", f"every replica needs the same scheme, got {ns.endpoint!r}")
            endpoint_scheme = scheme
            places.append(parse_endpoint(rest if sep else text, failing("endpoint")))
        (host, port), replicas = places[0], tuple(places[1:])
        scheme = endpoint_scheme
    token_file = ns.token_file if ns.token_file is not None else environ.get("RDZV_TOKEN_FILE") or None
    token = None
    if token_file is None and environ.get("RDZV_TOKEN"):
        token = environ["RDZV_TOKEN"].strip()
        problem = token_problem(token.encode())
        if problem:
            raise OptionsError(f"$RDZV_TOKEN: {problem}")
    if ns.tls_ca is not None and not os.path.isfile(ns.tls_ca):
        fail("tls_ca", f"no such file: {ns.tls_ca}")

    node_id = ns.node_id if ns.node_id is not None else _default_node_id()
    job_id = ns.job_id if ns.job_id is not None else _AGENT_DEFAULTS["job_id"]
    for dest, problem in (("node_id", node_id_problem(node_id)), ("job_id", job_id_problem(job_id))):
        if problem:   # the server's own rule, checked before anything connects
            fail(dest, problem)
    if ns.local_addr is not None and not ns.local_addr:
        fail("local_addr", "must not be empty")

    def number(dest: str) -> float:
        """A setting of this agent's own (not the job's): seconds, >= 0 and finite."""
        raw = getattr(ns, dest)
        if raw is None:
            return float(_AGENT_DEFAULTS[dest])
        value = _seconds(raw, failing(dest))
        if not math.isfinite(value) or value < 0:
            fail(dest, f"must be >= 0 and finite, got {raw!r}")
        return value

    given = {dest: getattr(ns, dest) for dest in _JOB_FLAGS if getattr(ns, dest) is not None}
    job = _job_config(given, min_nodes, max_nodes, nodes_flag="j" if ns.j else "nnodes", fail=fail)
    return AgentOptions(
        script=ns.script, script_args=tuple(ns.script_args), endpoint_host=host, endpoint_port=port,
        endpoint_scheme=endpoint_scheme, endpoint_replicas=replicas, token_file=token_file, token=token,
        tls_ca=ns.tls_ca,
        nproc=nproc, nproc_spec=nproc_text, job_id=job_id, job=job, node_id=node_id, local_addr=ns.local_addr,
        role=ns.role if ns.role is not None else _AGENT_DEFAULTS["role"], module=ns.module, no_python=ns.no_python,
        log_dir=ns.log_dir, standalone=ns.standalone,
        redirects=parse_std(ns.redirects or "0", failing("redirects")),
        tee=parse_std(ns.tee or "0", failing("tee")),
        local_ranks_filter=_rank_set(ns.local_ranks_filter, failing("local_ranks_filter")),
        stop_timeout=number("stop_timeout"), server_wait=number("server_wait"),
        hang_timeout=number("hang_timeout"), warnings=tuple(warnings),
    )


def agent_token(opts: AgentOptions) -> str | None:
    """The server's token: the file's (read now, at start-up), else $RDZV_TOKEN's, else None."""
    if opts.token_file is None:
        return opts.token
    try:
        with open(opts.token_file, "rb") as f:
            raw = f.read(MAX_TOKEN_CHARS + 64).strip()
    except OSError as exc:
        raise OptionsError(f"--token-file {opts.token_file}: {exc.strerror or exc}") from None
    problem = token_problem(raw)
    if problem:
        raise OptionsError(f"--token-file {opts.token_file}: {problem}")
    return raw.decode()


def _job_config(given: dict[str, str], min_nodes: int, max_nodes: int, *, nodes_flag: str,
                fail: Callable[[str, str], NoReturn]) -> JobConfig:
    """The job's settings from the flags given (dest -> text); JobConfig supplies the defaults and bounds."""
    values: dict[str, Any] = {"min_nodes": min_nodes, "max_nodes": max_nodes}
    for dest, raw in given.items():
        why = functools.partial(fail, dest)
        values[dest] = _int(raw, why) if isinstance(_JOB_DEFAULTS[dest], int) else _seconds(raw, why)
    try:
        return msgspec.convert(values, JobConfig)
    except msgspec.ValidationError as exc:   # e.g. "Expected `int` >= 0 - at `$.max_restarts`"
        text, _, where = str(exc).partition(" - at ")
        field = where.strip("`").removeprefix("$.")
        dest = nodes_flag if field in ("min_nodes", "max_nodes") else field
        got = f", got {given[dest]!r}" if dest in given else ""
        fail(dest, re.sub(r"^Expected `\w+` ", "must be ", text) + got)
