"""deploy/container: both Dockerfiles pass hadolint; the server image's entrypoint, health check and
stop signal are exercised against a real rdzv-server process, as the container would run them.

No image is built here: there is no Docker engine on this machine (only the docker CLI) and no
registry to pull the python base image from. What the image would run is run instead.
"""
from __future__ import annotations

import fnmatch
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys

import pytest

from tests.deploy.command_lines import server_args
from tests.deploy.tools import ROOT, deploy_path, venv_tool
from tests.e2e.harness import Proc, child_env

DOCKERFILE = deploy_path("container", "Dockerfile")
TRAINING = deploy_path("container", "training.Dockerfile")
IGNORE = deploy_path("container", "Dockerfile.dockerignore")


def instructions(path: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    with open(path) as f:
        lines = [ln for ln in f.read().splitlines() if not ln.lstrip().startswith("#")]
    text = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    out = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def last(path: str, word: str) -> str:
    values = [rest for w, rest in instructions(path) if w == word]
    assert values, f"{path} has no {word}"
    return values[-1]


@pytest.mark.parametrize("path", [DOCKERFILE, TRAINING], ids=os.path.basename)
def test_hadolint_finds_nothing(path):
    result = subprocess.run([venv_tool("hadolint"), "--no-color", "--failure-threshold", "style", path],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_is_not_silently_passing_everything(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN apt-get install curl\n")     # untagged image, no -y, no pins
    result = subprocess.run([venv_tool("hadolint"), "--no-color", str(bad)], capture_output=True, text=True)
    assert result.returncode != 0 and "DL3006" in result.stdout


def test_server_image_runs_unprivileged_with_state_on_a_volume():
    user = last(DOCKERFILE, "USER")
    assert user.split(":")[0] not in ("root", "0")
    entry, cmd = json.loads(last(DOCKERFILE, "ENTRYPOINT")), json.loads(last(DOCKERFILE, "CMD"))
    assert entry == ["rdzv-server"]                      # exec form: the server is PID 1 and gets SIGTERM
    args = server_args(cmd)
    assert json.loads(last(DOCKERFILE, "VOLUME")) == [args.state_dir]
    assert last(DOCKERFILE, "EXPOSE") == str(args.port)
    assert last(DOCKERFILE, "STOPSIGNAL") == "SIGTERM"


def test_build_context_filter_lets_in_what_the_dockerfile_copies():
    with open(IGNORE) as f:
        rules = [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]

    def ignored(path: str) -> bool:       # Docker's rule: the last matching line wins
        verdict = False
        for rule in rules:
            negate = rule.startswith("!")
            pattern = rule.lstrip("!").rstrip("/")
            if fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/") or \
                    fnmatch.fnmatch(path, pattern.replace("**/", "*/")):
                verdict = not negate
        return verdict

    sources = []
    for word, rest in instructions(DOCKERFILE):
        if word == "COPY" and "--from" not in rest:
            sources += rest.split()[:-1]
    assert sources
    for src in sources:
        assert os.path.exists(os.path.join(ROOT, src)), src
        assert not ignored(src.rstrip("/")), f"{src} is copied but filtered out of the build context"
    for path in (".venv", ".git", "tests", "node_agent/__pycache__"):
        assert ignored(path), f"{path} would be sent to the build"


def test_entrypoint_healthcheck_and_stopsignal_against_a_real_server(tmp_path):
    """The image's CMD (with a free port and a temp state dir over it), its HEALTHCHECK command, and
    SIGTERM, as docker would do them."""
    cmd = json.loads(last(DOCKERFILE, "CMD"))
    state = tmp_path / "state"
    argv = [sys.executable, "-m", "rdzv_server.cli", *cmd, "--host", "127.0.0.1", "--port", "0",
            "--state-dir", str(state)]
    server = Proc(argv, child_env(), "server")
    try:
        port = server.wait_for_line(r"listening on http://[^:]+:(\d+)", 30).group(1)
        health = last(DOCKERFILE, "HEALTHCHECK")
        probe = json.loads(health[health.index("CMD") + 3:])
        assert probe[0] == "python" and ":29400/healthz" in probe[-1]
        check = [sys.executable, *probe[1:-1], probe[-1].replace(":29400/", f":{port}/")]
        assert subprocess.run(check, timeout=30).returncode == 0
        server.popen.send_signal(signal.SIGTERM)
        assert server.wait(30) == 0
        assert "rdzv-server stopped" in server.output
        assert any(state.iterdir()), "the store was not written to the state dir"
        # and the health check fails once nothing answers
        assert subprocess.run(check, timeout=30, capture_output=True).returncode != 0
    finally:
        server.kill_all()


def test_training_image_installs_no_torch_of_its_own():
    # node-agent's package requires torch only through its optional "train" extra
    requires = importlib.metadata.requires("elastic-launcher") or []
    torch = [r for r in requires if re.match(r"torch\b", r)]
    assert torch and all("extra ==" in r for r in torch), requires
    run = " ".join(rest for word, rest in instructions(TRAINING) if word == "RUN")
    assert "elastic_launcher-" in run and "torch" not in run
