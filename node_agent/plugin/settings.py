"""Settings of the torchrun plugin: torchrun's rendezvous parameters and `--rdzv-conf` in, one frozen
`PluginSettings` out; a bad value is one `SettingsError` line naming the key as typed. No torch import, so the
rules are tested without it. torch hands a handler the endpoint, run id, MIN:MAX nodes, `--local-addr` and
`--rdzv-conf`, but not this node's worker count nor the restart budget: `TorchLaunch` carries those from torch's
launch configuration (torch_internals), whoever started the launcher (torchrun, `accelerate launch`, `elastic_launch`).
`--rdzv-conf local_world_size=N,max_restarts=K` override them, and are required when it cannot be read: the
plugin never guesses. Without a run id (torchrun's `none`) the id is derived as node-agent's (cli/job_identity.py)."""
from __future__ import annotations

import math
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NoReturn, TypeVar

import msgspec

from node_agent.cli.job_identity import TORCHRUN_DEFAULT_ID, command_fingerprint, default_job_id
from node_agent.cli.rdzv_conf import INT_KEYS, KNOWN_KEYS, LOCAL_SECONDS, NO_TRANSPORT_CHOICE, SECONDS_KEYS, unquoted
from node_agent.cli.values import parse_server, server_token
from node_agent.client.ports import store_ports
from node_agent.client.transport import local_addr_towards
from node_agent.settings import default_node_id
from protocol.ids import job_id_problem, node_id_problem
from protocol.messages import JobConfig

BACKEND = "rdzv-server"
N = TypeVar("N", int, float)
NEEDS_SIZES = "local_world_size=N,max_restarts=K"   # what --rdzv-conf must give when torch's launch cannot be read


class SettingsError(ValueError):
    """A bad rendezvous parameter; the message is one line for the user."""


@dataclass(frozen=True)
class TorchLaunch:
    """What torch's launch configuration says that torch does not pass to a rendezvous handler."""
    local_world_size: int
    max_restarts: int
    role: str = "default"
    kind: str = "python"               # what each worker runs, as node-agent names it: python, module, ...
    script: str = ""
    script_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class PluginSettings:
    host: str                      # the rdzv-server
    port: int
    job_id: str
    node_id: str
    job_id_source: str             # where a derived job id came from ("" when given)
    addr: str                      # where other nodes reach this one (MASTER_ADDR when group rank 0)
    hostname: str
    local_world_size: int
    role: str
    config: JobConfig              # the job's settings, the same on every node
    server_wait_s: float           # keep retrying an unreachable server this long, then give up
    close_timeout_s: float         # at shutdown, how long the last report and leave may take
    store_timeout_s: float         # agents' c10d store operations of a round
    scheme: str = "http"           # https with --rdzv-conf tls_ca=F or an https:// endpoint
    token: str | None = None       # the server's bearer token (token_file=F, $RDZV_TOKEN_FILE, $RDZV_TOKEN)
    tls_ca: str | None = None      # CA bundle that must have signed the server's certificate


def _fail(key: str, why: str) -> NoReturn:
    raise SettingsError(f"--rdzv-conf {key}: {why}")


def _number(key: str, value: object, kind: type[N]) -> N:
    """`value` as seconds (float) or a count (int), >= 0 and finite; else a SettingsError naming `key`."""
    what = "a number of seconds" if kind is float else "a whole number"
    try:
        number = kind(str(value).strip())
    except ValueError:
        _fail(key, f"expected {what}, got {value!r}")
    if not math.isfinite(number) or number < 0:
        _fail(key, f"expected {what} >= 0, got {value!r}")
    return number


def plugin_settings(*, endpoint: str, run_id: str, min_nodes: int, max_nodes: int, local_addr: str | None,
                    conf: Mapping[str, object], launch: TorchLaunch | None,
                    environ: Mapping[str, str] = os.environ) -> PluginSettings:
    conf = unquoted(conf)      # torch's parser leaves a quoted --rdzv-conf's quotes in the first key and last value
    if "transport" in conf:
        raise SettingsError(f"--rdzv-conf transport: {NO_TRANSPORT_CHOICE}")
    if unknown := sorted(k for k in conf if k not in KNOWN_KEYS):
        raise SettingsError(f"--rdzv-conf: unknown key {unknown[0]!r} for --rdzv-backend {BACKEND}; "
                            f"known keys: {', '.join(KNOWN_KEYS)}")
    try:
        store_ports(environ)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None
    tls_ca = str(conf["tls_ca"]) if conf.get("tls_ca") else None
    if tls_ca is not None and not os.path.isfile(tls_ca):
        _fail("tls_ca", f"no such file: {tls_ca}")
    # "localhost": torch's default when the endpoint is empty; port 0 names no server, so it is refused
    scheme, host, port = parse_server(endpoint.strip() or "localhost", tls_ca,
                                      lambda why: _whole_line(f"--rdzv-endpoint: {why}"))
    token = server_token(str(conf["token_file"]) if conf.get("token_file") else None, "--rdzv-conf token_file",
                         environ, _whole_line)
    run_id, source = _job_id(run_id, launch, environ)
    job: dict[str, object] = {"min_nodes": min_nodes, "max_nodes": max_nodes}
    typed: dict[str, str] = {}          # JobConfig field -> the rdzv_conf key it came from
    for key, field in SECONDS_KEYS.items():
        if key in conf and not (key == "timeout" and "join_timeout" in conf):
            job[field], typed[field] = _number(key, conf[key], float), key
    local = {key: _number(key, conf[key], float) if key in conf else default
             for key, default in LOCAL_SECONDS.items()}
    ints = {key: _number(key, conf[key], int) for key in INT_KEYS if key in conf}
    missing = [key for key in ("local_world_size", "max_restarts") if key not in ints]
    if missing and launch is None:
        raise SettingsError(f"torch's launch configuration could not be read, so {' and '.join(missing)} "
                            f"{'is' if len(missing) == 1 else 'are'} not known: give --rdzv-conf {NEEDS_SIZES} "
                            f"(the workers on this node and the job's restart budget)")
    for key in ("exclude_after", "max_restarts"):
        if key in ints:
            job[key], typed[key] = ints[key], key
    if launch is not None and "max_restarts" not in ints:   # the job's restart budget: --rdzv-conf's, else torch's
        job["max_restarts"], typed["max_restarts"] = launch.max_restarts, "max_restarts (from --max-restarts)"
    local_world_size = ints.get("local_world_size", launch.local_world_size if launch else 1)
    if local_world_size < 1:
        _fail("local_world_size", f"expected at least 1 worker, got {local_world_size}")
    try:
        config = msgspec.convert(job, JobConfig)
    except msgspec.ValidationError as exc:
        raise SettingsError(f"--rdzv-conf {_name_key(str(exc), typed)}") from None

    node_id = str(conf.get("node_id") or default_node_id())
    if problem := node_id_problem(node_id):
        _fail("node_id", problem)
    return PluginSettings(
        host=host, port=port, job_id=run_id, node_id=node_id, job_id_source=source,
        addr=local_addr or local_addr_towards(host, port), hostname=socket.gethostname(),
        local_world_size=local_world_size, role=launch.role if launch else "default", config=config,
        server_wait_s=max(local["server_wait"], config.lease_timeout_s),
        close_timeout_s=local["close_timeout"], store_timeout_s=local["read_timeout"] or LOCAL_SECONDS["read_timeout"],
        scheme=scheme, token=token, tls_ca=tls_ca)


def _job_id(run_id: str, launch: TorchLaunch | None, environ: Mapping[str, str]) -> tuple[str, str]:
    """(the job id, where it came from when derived: "" when given)."""
    source = ""
    if run_id in (TORCHRUN_DEFAULT_ID, ""):
        if launch is None:
            raise SettingsError("no run id, and torch's launch did not say which command the workers run (the "
                                "plugin derives an id from it): give --rdzv-id ID, or set $PET_RDZV_ID where the "
                                "tool has no such flag (accelerate)")
        run_id, source = default_job_id(environ, command_fingerprint(launch.kind, launch.script, launch.script_args))
    if problem := job_id_problem(run_id):
        raise SettingsError(f"--rdzv-id (or $PET_RDZV_ID): {problem}")
    return run_id, source


def _whole_line(message: str) -> NoReturn:
    raise SettingsError(message)


def _name_key(message: str, typed: dict[str, str]) -> str:
    """msgspec names JobConfig fields ("... - at `$.last_call_s`"); name the rdzv_conf key instead."""
    m = re.search(r"(.*) - at `\$\.(\w+)`", message)
    if m is None:
        return message
    return f"{typed.get(m.group(2), m.group(2))}: {m.group(1).replace('Expected', 'expected')}"
