"""deploy/kubernetes, the pods as they would run: every file a container is pointed at (token and TLS
files, in flags and *_FILE variables) is read for real by a process with the pod's uid and groups,
from Secret volumes laid out with the kubelet's owners and modes (pod_files.py); the server pods let
`kubectl exec deploy/rdzv-server -- rdzv-ctl ...` find its tokens; the ServiceMonitor presents the
token the server reads.
"""
from __future__ import annotations

import base64
import os
import shutil
import subprocess
import sys
import tempfile

import jsonschema
import pytest

from tests.deploy.command_lines import agent_options, expand_k8s, server_args
from tests.deploy.pod_files import (
    PodFiles,
    container_env,
    identities,
    image_user,
    pod_templates,
    pointed_at,
    unreadable,
)
from tests.deploy.test_kubernetes import (
    K8S,
    KUSTOMIZATIONS,
    OTHER_KUSTOMIZATIONS,
    SAMPLE,
    container,
    one,
    render,
    validate,
)
from tests.deploy.tools import ROOT, deploy_path
from tests.e2e.harness import Proc, child_env
from tests.ports import free_port

SERVER_IMAGE = "registry.example.com/rdzv-server"       # what server/ and replicated/ set with `images:`
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="reading as the pod's uid needs root (setuid)")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("k8s") / "kubernetes"
    shutil.copytree(K8S, root)
    for where in ("server", "replicated"):
        for name in ("token", "admin-token"):
            (root / where / name).write_text(f"{where}-{name}-for-tests\n")
    return {k: render(root / k) for k in KUSTOMIZATIONS + OTHER_KUSTOMIZATIONS}


@pytest.fixture(scope="module")
def sources(rendered) -> dict[tuple[str, str], dict]:
    """Secrets and ConfigMaps by (kind, name): the training pods mount the server's Secret."""
    out: dict[tuple[str, str], dict] = {}
    for where in ("server", *KUSTOMIZATIONS, *OTHER_KUSTOMIZATIONS):     # server/'s Secret wins a name clash
        for obj in rendered[where]:
            if obj["kind"] in ("Secret", "ConfigMap"):
                out.setdefault((obj["kind"], obj["metadata"]["name"]), obj)
    return out


@pytest.fixture
def node_root():
    """A folder every uid may traverse (pytest's tmp_path is root's alone) standing for a node's disk."""
    # In /tmp itself: the suite's per-process TMPDIR (tests/conftest.py) is root's alone, like tmp_path.
    path = tempfile.mkdtemp(prefix="pod-files-", dir="/tmp")
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path)


def all_pods(rendered) -> list[tuple[str, dict]]:
    return [(f"{where}:{name}", pod) for where in ("server", "replicated", "training", "jobset")
            for name, pod in pod_templates(rendered[where])]


POD_IDS = ["server:Deployment/rdzv-server", "replicated:Deployment/rdzv-server", "training:Job/train-example",
           "jobset:JobSet/train-example/node"]


def test_every_workload_is_checked_here(rendered):
    assert [name for name, _ in all_pods(rendered)] == POD_IDS
    everywhere = {name for k in KUSTOMIZATIONS + OTHER_KUSTOMIZATIONS for name, _ in pod_templates(rendered[k])}
    assert everywhere == {name.split(":", 1)[1] for name in POD_IDS}


@needs_root
@pytest.mark.parametrize("which", POD_IDS)
def test_each_process_can_read_every_file_it_is_pointed_at(rendered, sources, node_root, which):
    pod = dict(all_pods(rendered))[which]
    c = container(pod["spec"])
    files = PodFiles(node_root, pod, c, sources)
    paths = pointed_at(c, container_env(c, SAMPLE))
    assert paths, f"{which}: no token file named: the check would prove nothing"
    user = image_user(deploy_path("container", "Dockerfile")) if c["image"].startswith(SERVER_IMAGE) else None
    for who in identities(pod["spec"], c, user):
        problems = unreadable(files, paths, who)
        assert not problems, f"{which}: " + "; ".join(problems.values())


@needs_root
def test_the_check_fails_where_the_kubelet_would_refuse(rendered, sources, node_root):
    """The same pod with the token Secret as the issue found it (0400, no fsGroup) cannot read its token."""
    pod = dict(all_pods(rendered))["server:Deployment/rdzv-server"]
    spec = {**pod["spec"], "securityContext": {k: v for k, v in pod["spec"]["securityContext"].items()
                                                if k != "fsGroup"}}
    broken = {**pod, "spec": spec}
    c = container(spec)
    files = PodFiles(node_root, broken, c, sources)
    who = identities(spec, c, image_user(deploy_path("container", "Dockerfile")))[0]
    problems = unreadable(files, pointed_at(c, container_env(c, SAMPLE)), who)
    assert problems and all("Permission denied" in why for why in problems.values()), problems


# -- operators in the server's pod ---------------------------------------------------------------------


@pytest.mark.parametrize("which", ["server:Deployment/rdzv-server", "replicated:Deployment/rdzv-server"])
def test_rdzv_ctl_in_the_server_pod_finds_both_tokens(rendered, which):
    c = container(dict(all_pods(rendered))[which]["spec"])
    env = container_env(c, SAMPLE)
    args = server_args(expand_k8s(c["args"], env))
    # rdzv-ctl reads $RDZV_TOKEN_FILE (status, job, events) and $RDZV_ADMIN_TOKEN_FILE (drain, close, ...)
    assert env.get("RDZV_TOKEN_FILE") == args.token_file and args.token_file
    assert env.get("RDZV_ADMIN_TOKEN_FILE") == args.admin_token_file and args.admin_token_file


@needs_root
def test_the_docs_operator_commands_work_in_the_server_pod(rendered, sources, node_root):
    """`kubectl exec deploy/rdzv-server -- rdzv-ctl status` (and an admin command): the server started
    with the manifest's flags, rdzv-ctl with the pod's environment and no flags, both reading the token
    files from the Secret volume as laid out for the pod. Only the port and the state dir differ."""
    pod = dict(all_pods(rendered))["server:Deployment/rdzv-server"]
    c = container(pod["spec"])
    files = PodFiles(node_root, pod, c, sources)
    env = container_env(c, SAMPLE)
    port = free_port()
    argv = []
    for arg in c["args"]:
        flag, _, value = arg.partition("=")
        if value.startswith("/") and files.volume_of(value) == "tokens":
            arg = f"{flag}={files.host_path(value)}"
        argv.append(arg)
    argv += ["--host=127.0.0.1", f"--port={port}", f"--state-dir={os.path.join(node_root, 'state')}"]
    server = Proc([sys.executable, "-m", "rdzv_server.cli", *argv], child_env(), "server")
    try:
        server.wait_for_line(r"listening on http://", 30)
        pod_env = {k: files.host_path(v) if k.endswith("_FILE") else v for k, v in env.items()}
        base = {k: v for k, v in child_env().items() if not k.startswith("RDZV_")}
        ctl_env = {**base, **pod_env, "RDZV_SERVER": f"http://127.0.0.1:{port}"}

        def ctl(*words: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "rdzv_ctl.cli", *words], env=ctl_env, capture_output=True,
                                  text=True, timeout=30)

        status = ctl("status")
        assert status.returncode == 0, status.stderr
        close = ctl("close", "no-such-job")        # past the admin token check: the server looks for the job
        assert close.returncode != 0 and "no job" in close.stderr and "token" not in close.stderr, close.stderr
    finally:
        server.kill_all()


# -- Prometheus ----------------------------------------------------------------------------------------


def test_the_servicemonitor_presents_the_token_the_server_reads(rendered):
    monitor = one(rendered["monitoring"], "ServiceMonitor")
    (endpoint,) = monitor["spec"]["endpoints"]
    auth = endpoint["authorization"]
    assert auth.get("type", "Bearer") == "Bearer"
    secret = one(rendered["server"], "Secret", auth["credentials"]["name"])
    c = container(one(rendered["server"], "Deployment")["spec"]["template"]["spec"])
    args = server_args(c["args"])
    # the key the server's --token-file comes from, through the pod's Secret volume
    volume = next(v for v in one(rendered["server"], "Deployment")["spec"]["template"]["spec"]["volumes"]
                  if v.get("secret", {}).get("secretName") == secret["metadata"]["name"])
    mount = next(m for m in c["volumeMounts"] if m["name"] == volume["name"])
    key = os.path.relpath(args.token_file, mount["mountPath"])
    assert auth["credentials"]["key"] == key and key in secret["data"]
    assert base64.b64decode(secret["data"][key]).strip()
    assert "bearerTokenSecret" not in endpoint        # one way of sending it, not two
    validate(monitor)
    for bad in ({"credentials": {"name": "rdzv-tokens"}}, {"type": "Basic", "credentials": auth["credentials"]}):
        with pytest.raises(jsonschema.ValidationError):
            validate({**monitor, "spec": {**monitor["spec"], "endpoints": [{**endpoint, "authorization": bad}]}})


# -- a lost server node --------------------------------------------------------------------------------


def node_loss_budget() -> dict[str, int]:
    """The table under 'The server's node is lost' in docs/deploy.md: step -> seconds."""
    with open(os.path.join(ROOT, "docs", "deploy.md")) as f:
        text = f.read()
    table = text[text.index("<!-- node-loss budget"):].split("\n\n", 1)[0]
    rows = [line.split("|")[1:3] for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    return {step.strip(): int(seconds) for step, seconds in rows[1:]}


def toleration_seconds(pod: dict) -> dict[str, int]:
    return {t["key"]: t["tolerationSeconds"] for t in pod["spec"].get("tolerations", [])
            if t.get("effect") == "NoExecute" and "tolerationSeconds" in t}


def test_agents_wait_out_the_loss_of_the_servers_node(rendered):
    """The documented sequence after a silent node loss (detection, eviction, forced detach, attach and
    start) uses the manifests' own tolerations, adds up, and fits in the training pods' --server-wait."""
    budget = node_loss_budget()
    total = budget.pop("total")
    assert set(budget) == {"node found lost", "server pod evicted", "volume detached",
                           "volume attached, server started"}
    assert sum(budget.values()) == total
    for which in ("server:Deployment/rdzv-server", "replicated:Deployment/rdzv-server"):
        tolerations = toleration_seconds(dict(all_pods(rendered))[which])
        assert tolerations == {"node.kubernetes.io/not-ready": budget["server pod evicted"],
                               "node.kubernetes.io/unreachable": budget["server pod evicted"]}, which
    for which in ("training:Job/train-example", "jobset:JobSet/train-example/node"):
        c = container(dict(all_pods(rendered))[which]["spec"])
        argv = expand_k8s(c["command"][1:] + c["args"], container_env(c, SAMPLE))
        assert agent_options(argv, {"CUDA_VISIBLE_DEVICES": "0"}).server_wait >= total, which
