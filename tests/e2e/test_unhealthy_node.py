"""End-to-end: a node whose own check fails while its workers run (here the site's --health-check, as a
broken GPU would through NVML) leaves, a hot spare takes its place with no restart counted, the server
records why and keeps its host out, and the job runs to success. Real server, agents and gloo workers."""
from __future__ import annotations

import pytest

from tests.e2e.harness import job_events, job_view
from tests.e2e.test_elastic import LIMIT, assert_clean_world, kinds, start_agent, stop_job, wait_world

pytestmark = pytest.mark.e2e


def test_a_node_failing_its_check_leaves_and_a_spare_takes_over_without_a_restart(cluster, tmp_path):
    cluster.start_server()
    check = tmp_path / "site-check.sh"
    check.write_text('#!/bin/sh\nif [ -e "$BROKEN" ]; then echo "GPU 3: Xid 79, fallen off the bus"; exit 1; fi\n')
    check.chmod(0o755)

    def agent(node: str):
        return start_agent(cluster, tmp_path, node, job="sick", nnodes="2:2",
                           extra=("--health-check", str(check), "--gpu-check-interval", "0.5"),
                           env={"BROKEN": str(tmp_path / f"broken-{node}")})

    agents = {n: agent(n) for n in ("a", "b")}
    key1, recs1 = wait_world(tmp_path, world=2, nodes=("a", "b"))
    agents["c"] = agent("c")
    agents["c"].wait_for_line(r"waiting as spare #1", LIMIT)

    (tmp_path / "broken-b").touch()
    agents["b"].wait_for_line(r"node unhealthy \(while workers run\): health check .* exited with status 1: "
                              r"'GPU 3: Xid 79, fallen off the bus'; leaving the job", LIMIT)
    key2, recs2 = wait_world(tmp_path, world=2, nodes=("a", "c"), exclude=(key1,), what="with the spare")
    assert key2[2] == 0, "an unhealthy node must not consume the restart budget"
    assert_clean_world(recs2, 2)
    job = job_view(cluster, "sick")
    assert job is not None and job["restart_count"] == 0
    [gone] = kinds(job_events(cluster, "sick"), "node_unhealthy", "b")
    assert "exited with status 1: 'GPU 3: Xid 79, fallen off the bus'" in gone["message"]
    assert gone["data"]["kind"] == "health_check"
    [held] = cluster.get("/v1/status")["unhealthy_hosts"]
    assert held["node_id"] == "b" and held["kind"] == "health_check"

    stop_job(tmp_path)
    for n in ("a", "c"):
        assert agents[n].wait(LIMIT) == 0, agents[n].output
    assert job_view(cluster, "sick")["state"] == "succeeded"     # b's agent, still out, is stopped by the harness
