"""deploy/systemd: both units pass `systemd-analyze verify` as shipped (in a throwaway root holding
the programs they name), the server's sandbox rates <= 3.0 in `systemd-analyze security`, and their
ExecStart lines are command lines rdzv-server and node-agent accept.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess

import pytest

from tests.deploy.command_lines import agent_options, server_args
from tests.deploy.tools import debian_tool, deploy_path

SERVER_UNIT = deploy_path("systemd", "rdzv-server.service")
AGENT_UNIT = deploy_path("systemd", "node-agent@.service")
AGENT_ENV = deploy_path("systemd", "node-agent.env")
MAX_EXPOSURE = 3.0


def unit_settings(path: str) -> dict[str, list[str]]:
    """KEY -> every value it is given, with continuation lines joined and comments dropped."""
    settings: dict[str, list[str]] = {}
    with open(path) as f:
        text = re.sub(r"\\\n\s*", " ", f.read())
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] in "#;[":
            continue
        key, _, value = line.partition("=")
        settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def env_file(path: str) -> dict[str, str]:
    env = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                key, _, value = line.partition("=")
                env[key] = value
    return env


def exec_start(path: str, env: dict[str, str], specifiers: dict[str, str]) -> list[str]:
    """ExecStart as systemd would run it: specifiers, then ${VAR} as one word and $VAR split on spaces."""
    (line,) = unit_settings(path)["ExecStart"]
    for spec, value in specifiers.items():
        line = line.replace(spec, value)
    argv = []
    for word in shlex.split(line):
        if re.fullmatch(r"\$[A-Za-z_]\w*", word):
            argv.extend(env[word[1:]].split())
        else:
            argv.append(re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], word))
    return argv


@pytest.fixture
def root(tmp_path):
    """A filesystem root for `systemd-analyze --root`: systemd's own units, ours, and stand-ins for
    the programs our units start (verify checks that ExecStart's program is executable)."""
    analyze = debian_tool("systemd-analyze")
    system_units = "/usr/lib/systemd/system"
    if not os.path.isdir(system_units):
        pytest.skip(f"{system_units} is missing: systemd-analyze verify needs systemd's own units")
    shutil.copytree(system_units, tmp_path / "usr/lib/systemd/system", symlinks=True)
    etc = tmp_path / "etc/systemd/system"
    etc.mkdir(parents=True)
    for unit in (SERVER_UNIT, AGENT_UNIT):
        shutil.copy(unit, etc)
        program = tmp_path / unit_settings(unit)["ExecStart"][0].split()[0].lstrip("/")
        program.parent.mkdir(parents=True, exist_ok=True)
        program.write_text("#!/bin/sh\n")
        program.chmod(0o755)
    return analyze, tmp_path


def analyze(root, *args: str) -> subprocess.CompletedProcess:
    tool, path = root
    return subprocess.run([tool, *args, f"--root={path}"], capture_output=True, text=True, timeout=60)


def test_units_verify_cleanly_as_shipped(root):
    result = analyze(root, "verify", "rdzv-server.service", "node-agent@example-job.service")
    # any warning (an unknown key, a bad value) is printed even when the exit status is 0
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), result.stdout + result.stderr


def test_verify_catches_a_unit_whose_program_is_missing(root):
    # the harness itself: with the stand-in program gone, verify must fail as it did for the old unit
    program = unit_settings(SERVER_UNIT)["ExecStart"][0].split()[0]
    os.unlink(os.path.join(root[1], program.lstrip("/")))
    result = analyze(root, "verify", "rdzv-server.service")
    assert result.returncode != 0 and "not executable" in result.stderr


def exposure(root, unit: str) -> float:
    result = analyze(root, "security", "--offline=true", unit)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", result.stdout)
    assert result.returncode == 0 and m, result.stdout + result.stderr
    return float(m.group(1))


def test_server_unit_is_hardened(root):
    assert exposure(root, "rdzv-server.service") <= MAX_EXPOSURE


def test_server_exec_start_is_accepted_by_rdzv_server():
    settings = unit_settings(SERVER_UNIT)
    argv = exec_start(SERVER_UNIT, {}, {"%d": "/run/credentials/rdzv-server.service"})
    assert argv[0].endswith("/rdzv-server")
    args = server_args(argv[1:])
    assert (args.host, args.port) == ("0.0.0.0", 29400)
    # the state dir is the one systemd creates and hands to the service user
    assert args.state_dir == "/var/lib/" + settings["StateDirectory"][0]
    # every token file it names is a credential systemd loads
    creds = {value.split(":", 1)[0] for value in settings["LoadCredential"]}
    named = {a.rsplit("/", 1)[1] for a in argv if a.startswith("/run/credentials/")}
    assert named and named <= creds


def test_agent_unit_runs_the_example_settings():
    env = env_file(AGENT_ENV)
    argv = exec_start(AGENT_UNIT, env, {"%i": "llama-7b", "%H": "gpu-node-17", "%d": "/run/credentials/x"})
    assert argv[0].endswith("/node-agent")
    opts = agent_options(argv[1:], {"CUDA_VISIBLE_DEVICES": "0,1,2,3"})     # a host with 4 GPUs
    assert (opts.endpoint, opts.job_id, opts.node_id) == (env["RDZV_ENDPOINT"], "llama-7b", "gpu-node-17")
    assert (opts.job.min_nodes, opts.job.max_nodes, opts.nproc, opts.job.max_restarts) == (2, 4, 4, 3)
    assert [opts.script, *opts.script_args] == env["TRAIN_COMMAND"].split()
    # the token reaches the agent through RDZV_TOKEN_FILE, a credential of the unit
    settings = unit_settings(AGENT_UNIT)
    assert "RDZV_TOKEN_FILE=%d/token" in settings["Environment"]
    assert any(v.startswith("token:") for v in settings["LoadCredential"])


def test_command_line_checks_reject_flags_the_programs_do_not_have():
    # the checks above would be worthless if they let anything through
    with pytest.raises(AssertionError):
        server_args(["--host", "0.0.0.0", "--prot", "29400"])
    with pytest.raises(ValueError):
        agent_options(["--endpoint", "h:1", "--node-idd", "x", "train.py"], {})
    # a pending trust flag is taken off only with its value; the script's own flags are left alone
    opts = agent_options(["--endpoint", "h:1", "--token-file", "/t", "--node-id", "n", "train.py", "--token-file",
                          "x"], {})
    assert (opts.node_id, opts.script, opts.script_args) == ("n", "train.py", ("--token-file", "x"))
