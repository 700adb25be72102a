"""deploy/kubernetes/replicated, offline: two rdzv-server replicas on an existing etcd. Every object
passes Kubernetes' schema (strict), the server accepts the command line, the Service selects the
replicas' pods, which advertise their own address to agents a standby redirects, and neither a
rollout nor evictions take both replicas down: a standby is Ready (its readiness route answers 200,
checked against the real app), so the rollout can wait for it and the PodDisruptionBudget counts it."""
from __future__ import annotations

import shutil

import aiohttp
import pytest

from rdzv_server.coordinator import Coordinator
from rdzv_server.web.app import create_app
from tests.deploy.command_lines import expand_k8s, server_args
from tests.deploy.test_kubernetes import K8S, container, one, render, validate
from tests.integration.support import start_app


@pytest.fixture(scope="module")
def objs(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("k8s") / "kubernetes"
    shutil.copytree(K8S, root)
    for name in ("token", "admin-token"):
        (root / "replicated" / name).write_text(f"{name}-for-tests\n")
    return render(root / "replicated")


def test_every_object_passes_its_schema(objs):
    assert {o["kind"] for o in objs} == {"Deployment", "Service", "NetworkPolicy", "Secret", "PodDisruptionBudget"}
    for obj in objs:
        validate(obj)


def test_two_replicas_on_etcd_advertising_their_pod_address(objs):
    dep = one(objs, "Deployment", "rdzv-server")
    assert dep["spec"]["replicas"] == 2
    pod = dep["spec"]["template"]["spec"]
    c = container(pod)
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"] if "valueFrom" in e}
    assert env == {"POD_IP": "status.podIP"}
    args = server_args(expand_k8s(c["args"], {"POD_IP": "10.1.2.3"}))
    assert args.store.startswith("etcd://") and args.state_dir is None and args.etcd_prefix
    assert args.advertise_url == f"http://10.1.2.3:{args.port}"
    assert not any("persistentVolumeClaim" in v for v in pod["volumes"])
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "rdzv"}
    spread = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert spread["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert spread["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= \
        dep["spec"]["template"]["metadata"]["labels"].items()


def test_the_service_and_policy_select_the_replicas_and_replicas_reach_each_other(objs):
    labels = one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    svc = one(objs, "Service", "rdzv-server")
    assert svc["spec"]["selector"].items() <= labels.items()
    assert "publishNotReadyAddresses" not in svc["spec"]        # a replica still starting gets no agents
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


# -- rollouts and evictions never take both replicas down ------------------------------------------------


async def answers(path: str, standby: bool) -> int:
    """The status the real app gives `path` on a replica that leads, or on a standby that knows its leader."""
    coord = Coordinator()
    if standby:
        coord.gate.leader_url = lambda: "http://10.1.2.4:29400"
    srv = await start_app(create_app(coord, standby=standby))
    try:
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{srv.port}{path}") as resp:
            return resp.status
    finally:
        await srv.close()


async def test_a_rollout_starts_a_replica_before_it_stops_one_and_the_standby_counts(objs):
    dep = one(objs, "Deployment")
    rolling = dep["spec"]["strategy"]["rollingUpdate"]
    assert dep["spec"]["strategy"]["type"] == "RollingUpdate"
    assert rolling["maxUnavailable"] == 0 and rolling["maxSurge"] >= 1
    assert dep["spec"].get("minReadySeconds", 0) >= 5    # a new replica that crashes at once stops the rollout
    probe = container(dep["spec"]["template"]["spec"])["readinessProbe"]
    # maxUnavailable 0 waits for the new pod to be Ready, which a new replica is as a standby: the
    # readiness route must answer 200 there, not only on the leader (/readyz would hang the rollout)
    assert await answers(probe["httpGet"]["path"], standby=True) == 200
    assert await answers("/readyz", standby=True) == 503
    # one slow answer does not take a replica out of the Service
    assert probe["failureThreshold"] >= 3 and probe["timeoutSeconds"] >= 2


def test_evictions_leave_one_replica_running(objs):
    dep = one(objs, "Deployment")
    pdb = one(objs, "PodDisruptionBudget", "rdzv-server")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # of the two, one at most may be evicted at a time; since both are Ready, one always may be
    assert pdb["spec"]["minAvailable"] == 1 and dep["spec"]["replicas"] - pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
