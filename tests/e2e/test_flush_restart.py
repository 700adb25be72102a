"""An agent restarted under its own id (SIGTERM, started again as soon as it exits) while its copies are slow to
reach their holder (~12 MB a push at --replica-bandwidth 1M): its last copies (PeerCopies.close) must leave its
next agent time to join within the place the job keeps for it. A review: the flush took its full 10 s, past the
window (stop 2 s + lease 3 s + last call 3 s); the elastic job shrank and every sharded rank went back to step 0.
Real server and three agents on 127.0.0.1, 2 gloo workers each running benchmarks/scripts/shard_train.py."""
from __future__ import annotations

import os
import signal
import time

import pytest

from tests.e2e.harness import job_view, shard_resumes, wait_until
from tests.e2e.test_peer_copies import LIMIT, SHARDS, steps

pytestmark = pytest.mark.e2e
FLAGS = ("--nnodes", "2:3", "--nproc", "2", "--max-restarts", "3", "--lease-timeout", "3", "--stop-timeout", "2",
         "--last-call", "3", "--replica-bandwidth", "1M")


def start(cluster, out, node: str, job: str):
    return cluster.agent("--endpoint", cluster.endpoint(), "--job-id", job, "--node-id", node, "--failure-domain",
                         f"rack-{node}", *FLAGS, SHARDS, name=node,
                         env={"OUT_DIR": str(out), "NODE": node, "STATE_MB": "6", "STEP_S": "0.1", "SNAP_EVERY": "5",
                              "DISK_EVERY": "0"})


def test_a_restart_with_slow_copies_keeps_its_place_and_every_ranks_step(cluster, tmp_path):
    job = "flush-restart"
    cluster.start_server()
    agents = {n: start(cluster, tmp_path, n, job) for n in ("a", "b", "c")}
    wait_until(lambda: len({r for *_, r, _ in steps(tmp_path)}) == 6, LIMIT, "every rank stepping")
    node = next(n["node_id"] for n in job_view(cluster, job)["nodes"] if n["group_rank"] == 1)
    wait_until(lambda: any(n.get("copies", {}).get("copied_step", -1) >= 0 for n in job_view(cluster, job)["nodes"]
                           if n["node_id"] == node), LIMIT, "a copy landed")
    stopped_at = time.time()
    os.kill(agents[node].pid, signal.SIGTERM)
    assert agents[node].wait(LIMIT) == 128 + signal.SIGTERM, agents[node].output
    agents[node] = start(cluster, tmp_path, node, job)
    back = wait_until(lambda: len(shard_resumes(tmp_path, stopped_at)) == 6 and shard_resumes(tmp_path, stopped_at),
                      LIMIT, lambda: f"every rank resumed: {shard_resumes(tmp_path, stopped_at)}")
    (tmp_path / "stop").write_text("stop")
    for agent in agents.values():
        agent.wait(LIMIT)
    assert {source for _, source, _ in back.values()} == {"memory"}, (back, agents[node].output)
    assert len({step for step, _, _ in back.values()}) == 1 and min(s for s, _, _ in back.values()) > 0, back
