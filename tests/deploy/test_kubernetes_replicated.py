"""deploy/kubernetes/replicated, offline: two rdzv-server replicas on an existing etcd. Every object
passes Kubernetes' schema (strict), the server accepts the command line, only the leader can be
Ready (readiness on /readyz) and the Service selects the replicas' pods, which advertise their own
address to agents a standby redirects."""
from __future__ import annotations

import shutil

import pytest

from tests.deploy.command_lines import expand_k8s, server_args
from tests.deploy.test_kubernetes import K8S, container, one, render, validate


@pytest.fixture(scope="module")
def objs(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("k8s") / "kubernetes"
    shutil.copytree(K8S, root)
    for name in ("token", "admin-token"):
        (root / "replicated" / name).write_text(f"{name}-for-tests\n")
    return render(root / "replicated")


def test_every_object_passes_its_schema(objs):
    assert {o["kind"] for o in objs} == {"Deployment", "Service", "NetworkPolicy", "Secret"}
    for obj in objs:
        validate(obj)


def test_two_replicas_on_etcd_advertising_their_pod_address(objs):
    dep = one(objs, "Deployment", "rdzv-server")
    assert dep["spec"]["replicas"] == 2
    # only the leader is Ready: a rollout must not wait for the new pods to become Ready
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == "100%"
    pod = dep["spec"]["template"]["spec"]
    c = container(pod)
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"] if "valueFrom" in e}
    assert env == {"POD_IP": "status.podIP"}
    args = server_args(expand_k8s(c["args"], {"POD_IP": "10.1.2.3"}))
    assert args.store.startswith("etcd://") and args.state_dir is None and args.etcd_prefix
    assert args.advertise_url == f"http://10.1.2.3:{args.port}"
    assert not any("persistentVolumeClaim" in v for v in pod["volumes"])
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "rdzv"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "rdzv"}
    spread = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert spread["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert spread["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= \
        dep["spec"]["template"]["metadata"]["labels"].items()


def test_the_service_and_policy_select_the_replicas_and_replicas_reach_each_other(objs):
    labels = one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    svc = one(objs, "Service", "rdzv-server")
    assert svc["spec"]["selector"].items() <= labels.items()
    assert "publishNotReadyAddresses" not in svc["spec"]        # a standby must not get agents
    (port,) = svc["spec"]["ports"]
    assert port["port"] == 29400 and port["targetPort"] == "rdzv"
    pol = one(objs, "NetworkPolicy", "rdzv-server")
    assert pol["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    (rule,) = pol["spec"]["ingress"]
    peers = [p["podSelector"]["matchLabels"] for p in rule["from"] if "podSelector" in p and
             "namespaceSelector" not in p]
    assert any(sel.items() <= labels.items() for sel in peers), "a standby cannot probe the leader's port"


def test_the_tokens_are_the_same_secret_the_training_pods_mount(objs):
    dep = one(objs, "Deployment")
    c = container(dep["spec"]["template"]["spec"])
    secret = one(objs, "Secret")
    assert secret["metadata"]["name"] == "rdzv-tokens" and set(secret["data"]) == {"token", "admin-token"}
    assert "--token-file=/etc/rdzv/token" in c["args"]
