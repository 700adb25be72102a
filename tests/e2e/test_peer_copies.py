"""End-to-end peer copies (issue 46): a lost node's ranks resume from a peer's copy of their snapshots, not from
disk. Real server and agents on 127.0.0.1 (each node its own failure domain), 2 gloo workers per node running
benchmarks/scripts/shard_train.py: each rank owns a shard that tells its step, snapshots it every 5 steps and logs
how it resumed (OUT_DIR/resumed.txt) and each step. Waits are bounded polls of those files and the server's views.
"""
from __future__ import annotations

import glob
import os
import shutil
import signal
import time
import urllib.request

import pytest

from tests.e2e.harness import job_events, job_view, shard_resumes, wait_until

pytestmark = pytest.mark.e2e
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARDS = os.path.join(ROOT, "benchmarks", "scripts", "shard_train.py")
FAST = ("--lease-timeout", "3", "--last-call", "1", "--stop-timeout", "2")
LIMIT = 120.0
ENV = {"STATE_MB": "1", "STEP_S": "0.1", "SNAP_EVERY": "5", "DISK_EVERY": "0"}


def start(cluster, out, node: str, job: str):
    return cluster.agent("--endpoint", cluster.endpoint(), "--nnodes", "2:3", "--nproc", "2", "--job-id", job,
                         "--max-restarts", "3", "--node-id", node, "--failure-domain", f"rack-{node}", *FAST, SHARDS,
                         name=node, env={"OUT_DIR": str(out), "NODE": node, **ENV})


def steps(out) -> list[tuple[float, int, int, str]]:
    """(time, step, rank, node) of every step logged."""
    rows = []
    for path in glob.glob(os.path.join(out, "steps-*.txt")):
        node = os.path.basename(path).split("-")[1]
        with open(path) as f:
            rows += [(float(p[0]), int(p[1]), int(p[4]), node) for p in (ln.split() for ln in f) if len(p) == 5]
    return rows


def test_the_node_taking_a_lost_nodes_place_resumes_from_its_peer_copy(cluster, tmp_path):
    cluster.start_server()
    agents = {n: start(cluster, tmp_path, n, "copies") for n in ("a", "b", "c")}
    wait_until(lambda: len({r for *_, r, _ in steps(tmp_path)}) == 6, LIMIT, "every rank stepping")
    agents["s"] = start(cluster, tmp_path, "s", "copies")
    agents["s"].wait_for_line(r"ready after", LIMIT)      # a spare still preparing takes no place
    lost = next(n["node_id"] for n in job_view(cluster, "copies")["nodes"] if n["group_rank"] == 1)
    # Its ranks' copies are on a peer once the views say so (the agents' polls carry it).
    wait_until(lambda: next(n for n in job_view(cluster, "copies")["nodes"] if n["node_id"] == lost)
               .get("copies", {}).get("copied_step", -1) >= 10, LIMIT, f"node {lost}'s copies of step 10 or later")

    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.port}/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    assert 'rdzv_job_copy_lag_steps{job="copies"}' in metrics and 'rdzv_job_copy_refusals{job="copies"} 0.0' in metrics
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.port}/jobs/copies", timeout=10) as resp:
        assert " &middot; copy " in resp.read().decode()           # the page's snapshot column

    killed_at = time.time()
    os.kill(agents[lost].pid, signal.SIGKILL)
    agents[lost].wait(LIMIT)
    for path in glob.glob(f"/dev/shm/node-agent-mem-{os.getuid()}/copies.{agents[lost].pid}.*"):
        shutil.rmtree(path)          # its host's memory is gone with it
    back = wait_until(lambda: len(shard_resumes(tmp_path, killed_at)) == 6 and shard_resumes(tmp_path, killed_at),
                      LIMIT,
                      lambda: f"every rank resumed: {shard_resumes(tmp_path, killed_at)}\n{agents['s'].output}")

    assert {source for _, source, _ in back.values()} == {"memory"}, (back, agents["s"].output)
    assert len({step for step, _, _ in back.values()}) == 1 and min(s for s, _, _ in back.values()) >= 10, back
    assert {ok for _, _, ok in back.values()} == {"ok"}, back          # each rank loaded its own shard
    assert f"fetched node {lost}'s snapshots" in agents["s"].output, agents["s"].output
    assert [e for e in job_events(cluster, "copies") if e["kind"] == "node_lost" and e["node_id"] == lost]

    (tmp_path / "stop").write_text("stop")
    for n, agent in agents.items():
        if n != lost:
            assert agent.wait(LIMIT) == 0, agent.output
