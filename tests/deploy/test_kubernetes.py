"""deploy/kubernetes, offline: every kustomization renders with kubectl's kustomize, every object it
yields passes Kubernetes' own schema (kubernetes-validate, strict: unknown fields are errors), the
CRD kinds pass schemas written from their documented APIs (tests/deploy/schemas), and the pieces fit
together: commands the programs accept, selectors that select, probes on the server's routes.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
from types import SimpleNamespace

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy.command_lines import agent_options, expand_k8s, server_args
from tests.deploy.tools import deploy_path, venv_tool

K8S = deploy_path("kubernetes")
SCHEMAS = os.path.join(os.path.dirname(__file__), "schemas")
# Oldest Kubernetes the manifests are for: Job pods carry the batch.kubernetes.io/job-name and
# controller-uid labels from 1.27. Built-in kinds are checked against it and the newest schema.
OLDEST_KUBERNETES = "1.27"
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring-v1.yaml",
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): "jobset-jobset-v1alpha2.yaml",
}
KUSTOMIZATIONS = [".", "server", "training", "network", "monitoring", "jobset"]
OTHER_KUSTOMIZATIONS = ["replicated"]      # checked in their own test files


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """A copy of deploy/kubernetes with the token files an installer creates (kustomize needs them)."""
    root = tmp_path_factory.mktemp("k8s") / "kubernetes"
    shutil.copytree(K8S, root)
    (root / "server" / "token").write_text("agent-token-for-tests\n")
    (root / "server" / "admin-token").write_text("admin-token-for-tests\n")
    return root


def render(path) -> list[dict]:
    result = subprocess.run([venv_tool("kubectl"), "kustomize", str(path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, f"kustomize {path}: {result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module")
def rendered(tree) -> dict[str, list[dict]]:
    return {k: render(tree / k) for k in KUSTOMIZATIONS}


def one(objs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def validate(obj: dict) -> None:
    key = (obj["apiVersion"], obj["kind"])
    if key in CRD_SCHEMAS:
        with open(os.path.join(SCHEMAS, CRD_SCHEMAS[key])) as f:
            jsonschema.validate(obj, yaml.safe_load(f))
    else:
        for version in (OLDEST_KUBERNETES, kubernetes_validate.utils.latest_version()):
            kubernetes_validate.validate(obj, version, strict=True)


# -- schema ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_rendered_object_passes_its_schema(rendered, kustomization):
    objs = rendered[kustomization]
    assert objs
    for obj in objs:
        validate(obj)
        if obj["kind"] == "JobSet":          # the embedded Job templates, against batch/v1 Job
            for rj in obj["spec"]["replicatedJobs"]:
                validate({"apiVersion": "batch/v1", "kind": "Job",
                          "metadata": {"name": f"{obj['metadata']['name']}-{rj['name']}"},
                          "spec": rj["template"]["spec"]})


def test_validators_reject_what_a_cluster_would(rendered):
    deployment = one(rendered["server"], "Deployment")
    typo = {**deployment, "spec": {**deployment["spec"], "replica": 1}}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(typo)
    monitor = one(rendered["monitoring"], "ServiceMonitor")
    bad = {**monitor, "spec": {**monitor["spec"], "endpoints": [{"port": "rdzv", "interval": "15 seconds"}]}}
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)
    jobset = one(rendered["jobset"], "JobSet")
    with pytest.raises(jsonschema.ValidationError):
        validate({**jobset, "spec": {**jobset["spec"], "failurePolicy": {"maxRestart": 0}}})


def test_every_manifest_file_is_rendered_by_some_kustomization():
    listed = set()
    for kfile in glob.glob(os.path.join(K8S, "**", "kustomization.yaml"), recursive=True):
        with open(kfile) as f:
            doc = yaml.safe_load(f)
        for res in doc.get("resources", []):
            path = os.path.normpath(os.path.join(os.path.dirname(kfile), res))
            listed.add(os.path.join(path, "kustomization.yaml") if os.path.isdir(path) else path)
    files = set(glob.glob(os.path.join(K8S, "**", "*.yaml"), recursive=True))
    kustomizations = {p for p in files if os.path.basename(p) == "kustomization.yaml"}
    # every kustomization is rendered here, and every other manifest is a resource of one of them
    assert {os.path.dirname(p) for p in kustomizations} == {os.path.normpath(os.path.join(K8S, k))
                                                           for k in KUSTOMIZATIONS + OTHER_KUSTOMIZATIONS}
    assert files - kustomizations <= listed


def test_server_kustomization_refuses_to_render_without_token_files(tmp_path):
    shutil.copytree(K8S, tmp_path / "k")
    for name in ("token", "admin-token"):
        (tmp_path / "k" / "server" / name).unlink(missing_ok=True)
    result = subprocess.run([venv_tool("kubectl"), "kustomize", str(tmp_path / "k" / "server")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "token" in result.stderr


def test_token_files_are_kept_out_of_git():
    for where in ("server", "replicated"):
        for name in ("token", "admin-token"):
            result = subprocess.run(["git", "check-ignore", "-q", os.path.join(K8S, where, name)])
            assert result.returncode == 0, f"deploy/kubernetes/{where}/{name} is not ignored by git"


# -- the server ----------------------------------------------------------------------------------------


def container(pod_spec: dict) -> dict:
    (c,) = pod_spec["containers"]
    return c


def test_server_deployment_is_one_recreated_replica_on_its_claim(rendered):
    objs = rendered["server"]
    dep = one(objs, "Deployment", "rdzv-server")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    pod = dep["spec"]["template"]["spec"]
    c = container(pod)
    args = server_args(c["args"])
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    # --state-dir is on the PersistentVolumeClaim the kustomization creates
    state = next(n for n, p in mounts.items() if p == args.state_dir)
    claim = volumes[state]["persistentVolumeClaim"]["claimName"]
    one(objs, "PersistentVolumeClaim", claim)
    # the image's user, unprivileged; probes on the server's own routes and port
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
    port = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert port["rdzv"] == args.port
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "rdzv"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "rdzv"}
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    # token files come from the generated Secret
    secret = one(objs, "Secret", volumes["tokens"]["secret"]["secretName"])
    token_dir = mounts["tokens"]
    for flag in ("--token-file", "--admin-token-file"):
        value = next(a.split("=", 1)[1] for a in c["args"] if a.startswith(flag + "="))
        assert os.path.dirname(value) == token_dir and os.path.basename(value) in secret["data"]


def test_service_and_servicemonitor_reach_the_server_pods(rendered):
    dep = one(rendered["server"], "Deployment")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    svc = one(rendered["server"], "Service", "rdzv-server")
    assert svc["spec"]["selector"].items() <= labels.items()
    (port,) = svc["spec"]["ports"]
    assert port["port"] == 29400 and port["targetPort"] == "rdzv"
    monitor = one(rendered["monitoring"], "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == [port["name"]]
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"


def training_pods(rendered) -> dict[str, dict]:
    job = one(rendered["training"], "Job")
    jobset = one(rendered["jobset"], "JobSet")
    (rj,) = jobset["spec"]["replicatedJobs"]
    return {"indexed-job": job["spec"]["template"], "jobset": rj["template"]["spec"]["template"]}


def test_network_policies_let_agents_reach_the_server_and_each_other_on_every_port(rendered):
    server_pol = one(rendered["server"], "NetworkPolicy", "rdzv-server")
    server_labels = one(rendered["server"], "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert server_pol["spec"]["podSelector"]["matchLabels"].items() <= server_labels.items()
    (rule,) = server_pol["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 29400}]
    agent_sel = [p["podSelector"]["matchLabels"] for p in rule["from"] if "podSelector" in p]
    train_pol = one(rendered["network"], "NetworkPolicy", "rdzv-training")
    for name, pod in training_pods(rendered).items():
        labels = pod["metadata"]["labels"]
        assert any(sel.items() <= labels.items() for sel in agent_sel), name
        assert train_pol["spec"]["podSelector"]["matchLabels"].items() <= labels.items(), name
    (peers,) = train_pol["spec"]["ingress"]
    assert "ports" not in peers          # MASTER_PORT and gloo/NCCL ports are chosen at run time


# -- the training side ---------------------------------------------------------------------------------


# What the downward API gives one pod: its name and IP, and the labels and annotations the Job and
# JobSet controllers put on their pods (batch.kubernetes.io/* from Kubernetes 1.27, the JobSet's uid
# label from JobSet v0.9.0). A label a pod lacks reads as "".
SAMPLE = {"metadata.name": "train-example-0-x7k2p", "status.podIP": "10.1.2.3",
          "metadata.labels['batch.kubernetes.io/job-name']": "train-example",
          "metadata.labels['batch.kubernetes.io/controller-uid']": "0b5a5d8e-1c2f-4a8e-9d7b-3f2e1a0c9b8d",
          "metadata.annotations['jobset.sigs.k8s.io/jobset-name']": "train-example",
          "metadata.labels['jobset.sigs.k8s.io/jobset-uid']": "5f1c2d3e-aaaa-4bbb-8ccc-0123456789ab",
          "metadata.annotations['jobset.sigs.k8s.io/restart-attempt']": "0"}
UIDS = ("metadata.labels['batch.kubernetes.io/controller-uid']", "metadata.labels['jobset.sigs.k8s.io/jobset-uid']")


def agent_of(pod: dict, fields: dict[str, str]) -> tuple[dict[str, str], SimpleNamespace]:
    """The container's env (in order: Kubernetes expands $(VAR) from the entries before) and the
    options node-agent makes of its command line, in a pod whose downward API gives `fields`."""
    c = container(pod["spec"])
    env: dict[str, str] = {}
    for e in c["env"]:
        env[e["name"]] = (fields.get(e["valueFrom"]["fieldRef"]["fieldPath"], "") if "valueFrom" in e
                          else expand_k8s([e["value"]], env)[0])
    return env, agent_options(expand_k8s(c["command"][1:] + c["args"], env), {"CUDA_VISIBLE_DEVICES": "0"})


@pytest.mark.parametrize("variant", ["indexed-job", "jobset"])
def test_a_training_job_id_is_one_per_workload_object(rendered, variant):
    """Every pod of one Job (JobSet) has the same job id; a Job (JobSet) deleted and applied again
    under the same name, a new object with a new uid, has another: a finished job's id is not reused."""
    pod = training_pods(rendered)[variant]
    _, first = agent_of(pod, SAMPLE)
    _, other_pod = agent_of(pod, {**SAMPLE, "metadata.name": "train-example-1-q9z8w", "status.podIP": "10.1.2.4"})
    assert other_pod.job_id == first.job_id
    again = {**SAMPLE, **{f: "9d8c7b6a-0000-4111-8222-333344445555" for f in UIDS}}
    assert agent_of(pod, again)[1].job_id != first.job_id
    # the uid comes from a field that controller sets on every pod (for a JobSet: its own uid, the same
    # on the pods of all its Jobs, not a child Job's)
    refs = {e["valueFrom"]["fieldRef"]["fieldPath"] for e in container(pod["spec"])["env"] if "valueFrom" in e}
    assert refs & set(UIDS) == {UIDS[0] if variant == "indexed-job" else UIDS[1]}


@pytest.mark.parametrize("variant", ["indexed-job", "jobset"])
def test_training_pods_run_node_agent_against_the_service(rendered, variant):
    pod = training_pods(rendered)[variant]
    c = container(pod["spec"])
    env, opts = agent_of(pod, SAMPLE)
    assert c["command"][0] == "node-agent"
    svc = one(rendered["server"], "Service", "rdzv-server")
    assert (opts.endpoint_host, opts.endpoint_port) == (svc["metadata"]["name"], svc["spec"]["ports"][0]["port"])
    # node id: the pod's name; the address other pods reach it at: the pod's IP; one job id per
    # Job object (its uid) or per JobSet attempt
    assert (opts.node_id, opts.local_addr) == ("train-example-0-x7k2p", "10.1.2.3")
    assert opts.job_id == {"indexed-job": "train-example-0b5a5d8e-1c2f-4a8e-9d7b-3f2e1a0c9b8d",
                           "jobset": "train-example-5f1c2d3e-aaaa-4bbb-8ccc-0123456789ab-attempt-0"}[variant]
    # as many pods as the nodes the job waits for
    spec = (one(rendered["training"], "Job")["spec"] if variant == "indexed-job"
            else one(rendered["jobset"], "JobSet")["spec"]["replicatedJobs"][0]["template"]["spec"])
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == opts.job.max_nodes
    # the agent's token is the key the server's Secret holds
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    token = next(a.split("=", 1)[1] for a in c["args"] if a.startswith("--token-file="))
    mount = next(m for m in c["volumeMounts"] if token.startswith(m["mountPath"] + "/"))
    secret = volumes[mount["name"]]["secret"]
    server_secret = one(rendered["server"], "Secret")
    assert secret["secretName"] == server_secret["metadata"]["name"]
    assert [i["key"] for i in secret["items"]] == ["token"] and "token" in server_secret["data"]
    assert pod["spec"]["restartPolicy"] == "Never"
    assert env["NCCL_SOCKET_IFNAME"] and env["GLOO_SOCKET_IFNAME"]
