"""Hangs, end to end: a real gloo DDP job of 2 nodes x 2 workers whose script knows nothing of node-agent. A rank
that stops coming to the collectives (asleep and deaf to SIGTERM, or stopped) is found with hang detection's
defaults, named as the root cause, and every rank trains again in a new process; ranks that compute for longer
than the stall threshold (an eval phase, a checkpoint write while the others wait at a barrier) are left alone."""
from __future__ import annotations

import os

import pytest

from tests.e2e.harness import SCRIPTS, job_events, job_view, pid_gone, wait_until

pytestmark = pytest.mark.e2e
STALL = os.path.join(SCRIPTS, "stall_worker.py")
LIMIT = 120.0
FAST = ("--lease-timeout", "3", "--last-call", "1", "--stop-timeout", "2")


def start_pair(cluster, out, job: str, env: dict[str, str]) -> dict:
    """Two nodes of two workers: a runs ranks 0-1, b (joining second) ranks 2-3."""
    cluster.start_server()
    agents = {}
    for node in ("a", "b"):
        agents[node] = cluster.agent("--endpoint", cluster.endpoint(), "--nnodes", "2", "--nproc", "2",
                                     "--job-id", job, "--max-restarts", "1", "--node-id", node, *FAST, STALL,
                                     name=node, env={"OUT_DIR": str(out), **env})
        if node == "a":
            wait_until(lambda: job_view(cluster, job, missing_ok=True), LIMIT, "a to create the job")
    return agents


def finish(agents: dict, cluster, job: str) -> dict:
    for a in agents.values():
        assert a.wait(LIMIT) == 0, a.output
    return job_view(cluster, job)


@pytest.mark.parametrize(("fault", "rank", "how"), [
    ("sleep", 3, "sat idle"),        # and deaf to SIGTERM: the stop escalates
    ("stop", 1, "was stopped"),      # SIGSTOP: SIGTERM reaches it once continued
])
def test_a_rank_that_stops_coming_is_named_and_every_rank_trains_again(cluster, tmp_path, fault, rank, how):
    job = f"hang-{fault}"
    agents = start_pair(cluster, tmp_path, job, {"FAULT": fault, "FAULT_RANK": str(rank), "FAULT_STEP": "15",
                                                 "SLEEP_IGNORES_TERM": "1"})
    faulted = tmp_path / f"faulted-{rank}"
    wait_until(faulted.exists, LIMIT, lambda: f"rank {rank} to fault; {[a.output for a in agents.values()]}")
    culprit_pid = int(faulted.read_text())
    view = finish(agents, cluster, job)
    assert view["state"] == "succeeded" and view["restart_count"] == 1, view
    assert pid_gone(culprit_pid, timeout=10), "the culprit outlived its round"
    assert all((tmp_path / f"started-{r}-1").exists() for r in range(4)), os.listdir(tmp_path)
    events = job_events(cluster, job)
    hang = [e for e in events if e["kind"] == "hang_detected"]
    assert len(hang) == 1 and hang[0]["data"]["culprit"] == rank, hang
    assert f"rank {rank} {how}" in hang[0]["message"] and "waited for it" in hang[0]["message"], hang
    states = {r["rank"]: r["state"] for r in hang[0]["data"]["ranks"]}
    assert states[rank] == ("quiet" if fault == "sleep" else "stopped")
    assert all(states[r] == "waiting" for r in range(4) if r != rank), states
    failed = [e for e in events if e["kind"] == "worker_failed"]
    assert [(e["data"]["rank"], e["data"]["reason"]) for e in failed] == [(rank, "hang")], failed
    culprit_node = agents["a" if rank < 2 else "b"]
    assert "what each is doing (the server decides whether the job hangs)" in culprit_node.output
    assert f"rank {rank} (local {rank % 2}): {'quiet' if fault == 'sleep' else 'stopped'}" in culprit_node.output


def test_ranks_that_compute_past_the_threshold_are_left_alone(cluster, tmp_path):
    job = "busy"
    agents = start_pair(cluster, tmp_path, job, {"FAULT": "busy", "EVAL_EVERY": "10", "EVAL_S": "7", "BUSY_S": "7",
                                                 "STEPS": "22"})
    view = finish(agents, cluster, job)
    assert view["state"] == "succeeded" and view["restart_count"] == 0, view
    assert not [e for e in job_events(cluster, job) if e["kind"] in ("hang_detected", "worker_failed")]
    said = agents["a"].output + agents["b"].output
    assert "what each is doing" in said and ": working" in said, said       # looked at, and left alone
