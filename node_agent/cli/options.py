"""The node agent's command line: flags (and torchrun's PET_* variables) in, the agent's settings out.
Every torchrun flag means what it means to torchrun, or is refused in one line naming the equivalent or why.
Every bad input is one `OptionsError` line naming the flag as spelled (or its PET_* variable); argparse never
exits (but for `--help`, status 0) nor prints a traceback. Values are checked here, once, so the rest of the
agent can trust them. No torch import: GPUs are counted from the driver's files."""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from node_agent.cli.command_line import JOB_DEFAULTS, CommandLine, OptionsError, job_config, one_line
from node_agent.cli.flags import FLAGS, FlagError, split_command_line
from node_agent.cli.flags import build_argparser as _build
from node_agent.cli.job_identity import TORCHRUN_DEFAULT_ID, command_fingerprint, default_job_id
from node_agent.cli.launch_form import launch_form
from node_agent.cli.rdzv_conf import AGENT_NOTES, IGNORED_KEYS, KNOWN_KEYS, NO_TRANSPORT_CHOICE, parse_conf
from node_agent.cli.values import (  # noqa: F401  (count_gpus: re-exported)
    _int,
    _rank_set,
    _seconds,
    _split_j,
    count_gpus,
    parse_filters,
    parse_modules,
    parse_nnodes,
    parse_signals,
    parse_size,
    parse_std,
    resolve_nproc,
    server_token,
)
from node_agent.settings import (
    DEFAULT_SIGNALS,
    DEFAULT_TEE_PREFIX,
    AgentSettings,
    CheckSettings,
    LinkSettings,
    Mode,
    WorkerSettings,
    default_node_id,
)
from protocol.ids import job_id_problem, node_id_problem

_AGENT_DEFAULTS: dict[str, Any] = {f.name: f.default for part in (WorkerSettings, LinkSettings, CheckSettings)
                                   for f in dataclasses.fields(part)}
# torchrun flags taking only the value meaning what node-agent does anyway: dest -> (that value or None; why).
_ONLY: dict[str, tuple[str | None, str]] = {
    "logs_specs": ("default", "node-agent loads no torch plugins (it never imports torch); its log layout is "
                              "torchrun's default (`default`, torch's DefaultLogsSpecs), under --log-dir"),
    "event_log_handler": ("null", "node-agent records the job's events at the rdzv-server (rdzv-ctl events JOB, "
                                  "or GET /v1/jobs/JOB/events)"),
}


def build_argparser() -> argparse.ArgumentParser:
    """The parser, its help showing the defaults (JobConfig's for job settings, the settings' otherwise)."""
    def text(dest: str, help: str) -> str:
        default = JOB_DEFAULTS.get(dest, _AGENT_DEFAULTS.get(dest))
        return help.format(default=default, cooldown_max=JOB_DEFAULTS["exclude_cooldown_max_s"])
    return _build({f.dest: text(f.dest, f.help) for f in FLAGS})


def parse_options(argv: Sequence[str], environ: Mapping[str, str] = os.environ) -> AgentSettings:
    """The command line read into what each part of the agent runs with (node_agent/settings.py)."""
    parser = build_argparser()
    try:
        options, rest = split_command_line(parser, argv)
        ns = parser.parse_args([*options, "--", rest[0]] if rest else options)
    except FlagError as exc:
        raise OptionsError(str(exc)) from None
    line = CommandLine(ns, environ)
    script, script_args = ns.script, tuple(rest[1:])
    get = line.get
    _check_refused(line)
    counts = _counts(line, environ)
    conf, warnings = _rdzv_conf(line)
    given_id = get("job_id") if get("job_id") not in (None, TORCHRUN_DEFAULT_ID) else None
    tls_ca = get("tls_ca") or conf.get("tls_ca")
    form = launch_form(backend=get("rdzv_backend"), endpoint=get("endpoint"), endpoint_flag=line.name("endpoint"),
                       standalone=bool(get("standalone")), master_addr=get("master_addr"),
                       master_port=get("master_port"), nodes=(counts.min_nodes, counts.max_nodes), job_id=given_id,
                       tls_ca=tls_ca, fail=line.fail, node_rank_given=get("node_rank") is not None)
    warnings += form.warnings
    min_nodes, max_nodes = (1, 1) if form.one_node else (counts.min_nodes, counts.max_nodes)
    run_path, module, no_python = bool(get("run_path")), bool(get("module")), bool(get("no_python"))
    kind = "run-path" if run_path else "program" if no_python else "module" if module else "python"
    fingerprint = command_fingerprint(kind, script, script_args)
    job_id, source, node_id = _identity(line, form.mode, form.job_id or given_id, conf, environ, fingerprint)
    node_rank = _node_rank(line, form.mode, max_nodes, counts.nnodes_text)
    role = _role(line, counts.nproc, environ)
    token_file, token = _token(line, conf, environ, tls_ca)
    stop_default = environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    link = LinkSettings(
        mode=form.mode, endpoint_host=form.host, endpoint_port=form.port, endpoint_scheme=form.scheme,
        endpoint_replicas=form.replicas, host_if_unserved=_may_host(form.host_if_unserved, form.scheme, token_file,
                                                                    token, conf),
        token_file=token_file if form.mode is Mode.SERVER else None,
        token=token if form.mode is Mode.SERVER else None, tls_ca=tls_ca, job_id_source=source,
        **_copy_tls(line, tls_ca),
        command="" if get("no_command_check") else fingerprint,
        job=job_config(line, conf, min_nodes, max_nodes, counts.nodes_flag), local_addr=get("local_addr"),
        node_rank=node_rank, master_addr=form.master_addr, master_port=form.master_port,
        server_wait=non_negative(line, "server_wait", conf.get("server_wait"), "--rdzv-conf server_wait"),
        nproc=counts.nproc, job_id=job_id, node_id=node_id, role=role,
        failure_domain=_failure_domain(line, environ))
    workers = WorkerSettings(
        script=script, script_args=script_args, module=module, no_python=no_python, run_path=run_path,
        log_dir=get("log_dir") or None, redirects=parse_std(get("redirects") or "0", line.failing("redirects")),
        tee=parse_std(get("tee") or "0", line.failing("tee")),
        local_ranks_filter=_rank_set(get("local_ranks_filter"), line.failing("local_ranks_filter")),
        dup_stdout=parse_filters(get("dup_stdout")) if get("dup_stdout") is not None else (),
        dup_stderr=parse_filters(get("dup_stderr")) if get("dup_stderr") is not None else (),
        log_line_prefix=get("log_line_prefix"),
        tee_prefix=environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE") or DEFAULT_TEE_PREFIX,
        virtual_local_rank=bool(get("virtual_local_rank")),
        signals=parse_signals(get("signals"), line.failing("signals")) if get("signals") else DEFAULT_SIGNALS,
        stop_timeout=non_negative(line, "stop_timeout", stop_default, "$TORCH_ELASTIC_SHUTDOWN_TIMEOUT"),
        kill_timeout=non_negative(line, "kill_timeout"),
        memory_dir_limit=_memory_dir_limit(line), copy_bandwidth=_copy_bandwidth(line),
        warm_workers=_choice(line, "warm_workers", ("auto", "off")),
        warm_preload=parse_modules(get("warm_preload"), line.failing("warm_preload"))
        if get("warm_preload") is not None else None,
        nproc=counts.nproc, job_id=job_id, node_id=node_id, role=role)
    checks = CheckSettings(nproc=counts.nproc, **_gpu_options(line))
    return AgentSettings(workers, link, checks, reply_file=environ.get("TORCHELASTIC_ERROR_FILE") or None,
                         warnings=tuple(warnings))


def _gpu_options(line: CommandLine) -> dict[str, Any]:
    """--numa-binding, the GPU check and --health-check (node_agent/gpu/)."""
    mode = line.get("numa_binding")
    if mode is not None:
        from node_agent.gpu.topology import parse_bind_mode  # only when asked: a CPU node's start stays light
        try:
            mode = parse_bind_mode(mode).value
        except ValueError as exc:
            line.fail("numa_binding", str(exc))
    check = line.get("health_check")
    if check is not None and not check.strip():
        line.fail("health_check", "must name a command")
    interval = non_negative(line, "gpu_check_interval")
    if interval == 0:
        line.fail("gpu_check_interval", "must be > 0 (turn the check off with --no-gpu-check)")
    return {"numa_binding": mode, "gpu_check": not line.get("no_gpu_check"), "gpu_check_interval": interval,
            "health_check": check, "health_check_timeout": non_negative(line, "health_check_timeout")}


def non_negative(line: CommandLine, dest: str, fallback: str | None = None, fallback_name: str = "") -> float:
    """A setting of this agent's own (not the job's): seconds, >= 0 and finite."""
    raw, fail = line.get(dest), line.failing(dest)
    if raw is None and fallback is not None:
        raw, fail = fallback, lambda why: one_line(f"{fallback_name}: {why}")
    if raw is None:
        return float(_AGENT_DEFAULTS.get(dest, 0.0))
    value = _seconds(raw, fail)
    if not math.isfinite(value) or value < 0:
        fail(f"must be >= 0 and finite, got {raw!r}")
    return value


def _choice(line: CommandLine, dest: str, choices: tuple[str, ...]) -> str:
    value = line.get(dest)
    if value is None:
        return str(_AGENT_DEFAULTS[dest])
    if value not in choices:
        line.fail(dest, f"expected {' or '.join(choices)}, got {value!r}")
    return str(value)


def _check_refused(line: CommandLine) -> None:
    """Flags whose combination or value node-agent refuses, before anything else is read."""
    get = line.get
    if get("module") and get("no_python") and not get("run_path"):   # --run-path wins over both, as in torchrun
        raise OptionsError("--no-python cannot be combined with -m/--module")
    if get("transport") is not None:
        line.fail("transport", NO_TRANSPORT_CHOICE)
    for dest, (only, why) in _ONLY.items():
        if get(dest) not in (None, only):
            line.fail(dest, f"only {only!r}, got {get(dest)!r}: {why}" if only else f"not supported: {why}")
    if get("start_method") not in (None, "spawn", "fork", "forkserver"):
        line.fail("start_method", f"expected spawn, fork or forkserver, got {get('start_method')!r}")
    if get("monitor_interval") is not None:
        non_negative(line, "monitor_interval")


@dataclass(frozen=True)
class _Counts:
    min_nodes: int
    max_nodes: int
    nproc: int
    nodes_flag: str          # the flag the node counts came from (errors name it)
    nnodes_text: str         # the node counts as given


def _counts(line: CommandLine, environ: Mapping[str, str]) -> _Counts:
    """Node and worker counts: -j is shorthand for --nnodes plus --nproc, so both at once is ambiguous."""
    get = line.get
    nproc_text: str = get("nproc") if get("nproc") is not None else "1"
    nnodes_text: str = get("nnodes") if get("nnodes") is not None else "1:1"
    if get("j") is not None:
        for other in ("nnodes", "nproc"):
            if get(other) is not None:
                raise OptionsError(f"{line.name('j')} conflicts with {line.name(other)}: give one or the other")
        nnodes_text, nproc_text = _split_j(get("j"), line.failing("j"))
    nodes_flag = "j" if get("j") is not None else "nnodes"
    min_nodes, max_nodes = parse_nnodes(nnodes_text, line.failing(nodes_flag))
    if nproc_text.strip() == "xpu":
        line.fail("j" if get("j") else "nproc", "node-agent counts NVIDIA GPUs only (gpu); give the number of workers")
    nproc = resolve_nproc(nproc_text, environ, line.failing("j" if get("j") else "nproc"))
    return _Counts(min_nodes, max_nodes, nproc, nodes_flag, nnodes_text)


def _may_host(hostable: bool, scheme: str, token_file: str | None, token: str | None,
              conf: Mapping[str, str]) -> bool:
    """One node at an endpoint on this host may run its rendezvous in the agent (Form.host_if_unserved), unless
    the line asks for a real server: TLS, a token, or `--rdzv-conf is_host=0`."""
    refused = conf.get("is_host", "").strip().lower() in ("0", "false", "no", "off")
    return hostable and scheme == "http" and not token_file and not token and not refused


def _rdzv_conf(line: CommandLine) -> tuple[dict[str, str], list[str]]:
    """--rdzv-conf's keys (each one known), and a warning for each that has no effect here."""
    try:
        conf = parse_conf(line.get("rdzv_conf") or "")
    except ValueError as exc:
        line.fail("rdzv_conf", str(exc))
    warnings = []
    for key in conf:
        if key == "transport":
            line.fail("rdzv_conf", f"transport: {NO_TRANSPORT_CHOICE}")
        if key not in KNOWN_KEYS and key not in AGENT_NOTES:
            line.fail("rdzv_conf", f"unknown key {key!r}; known keys: {', '.join(sorted({*KNOWN_KEYS, *AGENT_NOTES}))}")
        if key in AGENT_NOTES or key in IGNORED_KEYS:
            warnings.append(f"--rdzv-conf {key} has no effect: {AGENT_NOTES.get(key) or IGNORED_KEYS[key]}")
    return conf, warnings


def _identity(line: CommandLine, mode: Mode, job_id: str | None, conf: Mapping[str, str],
              environ: Mapping[str, str], fingerprint: str) -> tuple[str, str, str]:
    """The job id (and where it came from when not given) and this node's id, checked by the server's rules."""
    source = ""
    if job_id is None and mode is Mode.STATIC:
        job_id = line.get("job_id") or TORCHRUN_DEFAULT_ID   # torchrun's run id; no server, so nothing to merge
    if job_id is None:
        job_id, source = default_job_id(environ, fingerprint)
    node_id = line.get("node_id") or conf.get("node_id") or default_node_id()
    for dest, problem in (("node_id", node_id_problem(node_id)), ("job_id", job_id_problem(job_id))):
        if problem:   # the server's own rule, checked before anything connects
            line.fail(dest, problem)
    return job_id, source, node_id


def _node_rank(line: CommandLine, mode: Mode, max_nodes: int, nnodes_text: str) -> int:
    node_rank = _int(line.get("node_rank"), line.failing("node_rank")) if line.get("node_rank") is not None else 0
    if mode is Mode.STATIC and not 0 <= node_rank < max_nodes:
        line.fail("node_rank", f"must be 0..{max_nodes - 1} for --nnodes {nnodes_text}, got {node_rank}")
    if line.get("local_addr") == "":
        line.fail("local_addr", "must not be empty")
    return node_rank


def _role(line: CommandLine, nproc: int, environ: Mapping[str, str]) -> str:
    role: str = line.get("role") if line.get("role") is not None else "default"
    if len(role) > 64:
        line.fail("role", f"at most 64 characters, got {len(role)}")
    if line.get("virtual_local_rank") and environ.get("CUDA_VISIBLE_DEVICES") is not None:
        visible = environ["CUDA_VISIBLE_DEVICES"].split(",")   # torchrun's reading: each entry, even empty
        if nproc > len(visible):
            line.fail("virtual_local_rank", f"{nproc} workers but CUDA_VISIBLE_DEVICES lists {len(visible)} devices")
    return role


def _copy_bandwidth(line: CommandLine) -> int:
    given = line.get("copy_bandwidth")
    return WorkerSettings.copy_bandwidth if given is None else parse_size(given, line.failing("copy_bandwidth"))


def _failure_domain(line: CommandLine, environ: Mapping[str, str]) -> str:
    """--failure-domain, else Slurm's topology address without its last part (the node's switch), else ""."""
    given = line.get("failure_domain")
    if given is not None:
        if not given.isprintable() or not 0 < len(given) <= 256:
            line.fail("failure_domain", f"must be 1-256 printable characters, got {given[:64]!r}")
        return str(given)
    topology = environ.get("SLURM_TOPOLOGY_ADDR", "")
    return topology.rpartition(".")[0][:256] if topology.isprintable() else ""


def _memory_dir_limit(line: CommandLine) -> int | None:
    """--memory-dir-limit in bytes; --no-memory-dir is 0, and contradicts any other limit."""
    limit = parse_size(line.get("memory_dir_limit"), line.failing("memory_dir_limit")) \
        if line.get("memory_dir_limit") is not None else None
    if line.get("no_memory_dir"):
        if limit:
            raise OptionsError(f"{line.name('no_memory_dir')} conflicts with {line.name('memory_dir_limit')}")
        return 0
    return limit


def _copy_tls(line: CommandLine, tls_ca: str | None) -> dict[str, str | None]:
    """--tls-cert and --tls-key, both or neither, existing files, with a --tls-ca to check the other nodes by."""
    cert, key = line.get("tls_cert"), line.get("tls_key")
    if (cert is None) != (key is None):
        given = "tls_cert" if cert is not None else "tls_key"
        line.fail(given, f"needs {line.name('tls_key' if cert is not None else 'tls_cert')} too")
    for dest, path in (("tls_cert", cert), ("tls_key", key)):
        if path is not None and not os.path.isfile(path):
            line.fail(dest, f"no such file: {path}")
    if cert is not None and tls_ca is None:
        line.fail("tls_cert", "needs --tls-ca: the CA that signed the other nodes' certificates")
    return {"tls_cert": cert, "tls_key": key}


def _token(line: CommandLine, conf: Mapping[str, str], environ: Mapping[str, str],
           tls_ca: str | None) -> tuple[str | None, str | None]:
    """The token file (read at start-up), else $RDZV_TOKEN's token; and a --tls-ca that must exist."""
    token_file = line.get("token_file") or conf.get("token_file") or environ.get("RDZV_TOKEN_FILE") or None
    token = server_token(None, "--token-file", environ, one_line) if token_file is None else None
    if tls_ca is not None and not os.path.isfile(tls_ca):
        one_line(f"{line.name('tls_ca') if line.get('tls_ca') else '--rdzv-conf tls_ca'}: no such file: {tls_ca}")
    return token_file, token


def agent_token(link: LinkSettings) -> str | None:
    """The server's token: the file's (read now, at start-up, not while parsing), else $RDZV_TOKEN's."""
    if link.token_file is None:
        return link.token
    return server_token(link.token_file, "--token-file", {}, one_line)   # a file given: no variable is read

