"""Hangs, end to end: a real gloo DDP job of 2 nodes x 2 workers whose script knows nothing of node-agent. A rank
that cannot come to the collectives (stopped, or exited 0) and a deadlock (three ranks in a barrier, one in a recv)
are found with hang detection's defaults, named as the root cause, and every rank trains again in a new process. A
rank alone (asleep and deaf to SIGTERM) is a hang only at --hang-alone-timeout; ranks that compute for longer than
the stall threshold (an eval phase, a checkpoint write while the others wait at a barrier) are shown as alone and
left alone; and a solo spell decided a hang once is never decided again at that place."""
from __future__ import annotations

import os

import pytest

from tests.e2e.harness import SCRIPTS, job_events, job_view, pid_gone, wait_until

pytestmark = pytest.mark.e2e
STALL = os.path.join(SCRIPTS, "stall_worker.py")
LIMIT = 120.0
FAST = ("--lease-timeout", "3", "--last-call", "1", "--stop-timeout", "2")


def start_pair(cluster, out, job: str, env: dict[str, str], *extra: str) -> dict:
    """Two nodes of two workers: a runs ranks 0-1, b (joining second) ranks 2-3."""
    cluster.start_server()
    agents = {}
    for node in ("a", "b"):
        agents[node] = cluster.agent("--endpoint", cluster.endpoint(), "--nnodes", "2", "--nproc", "2",
                                     "--job-id", job, "--max-restarts", "1", "--node-id", node, *FAST, *extra, STALL,
                                     name=node, env={"OUT_DIR": str(out), **env})
        if node == "a":
            wait_until(lambda: job_view(cluster, job, missing_ok=True), LIMIT, "a to create the job")
    return agents


def finish(agents: dict, cluster, job: str) -> dict:
    for a in agents.values():
        assert a.wait(LIMIT) == 0, a.output
    return job_view(cluster, job)


@pytest.mark.parametrize(("fault", "rank", "how", "extra"), [
    ("stop", 1, "rank 1 was stopped", ()),               # SIGSTOP: SIGTERM reaches it once continued
    ("deadlock", 3, "deadlock: every rank waits on the others", ()),    # ranks 0-2 in a barrier, rank 3 in a recv
    ("sleep", 3, "rank 3 alone for", ("--hang-alone-timeout", "8")),   # and deaf to SIGTERM: the stop escalates
])
def test_a_rank_that_does_not_come_is_named_and_every_rank_trains_again(cluster, tmp_path, fault, rank, how,
                                                                         extra):
    job = f"hang-{fault}"
    agents = start_pair(cluster, tmp_path, job, {"FAULT": fault, "FAULT_RANK": str(rank), "FAULT_STEP": "15",
                                                 "SLEEP_IGNORES_TERM": "1"}, *extra)
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
    assert how in hang[0]["message"], hang
    states = {r["rank"]: r["state"] for r in hang[0]["data"]["ranks"]}
    assert states[rank] == {"stop": "stopped", "deadlock": "waiting", "sleep": "quiet"}[fault]
    assert all(states[r] == "waiting" for r in range(4) if r != rank), states
    failed = [e for e in events if e["kind"] == "worker_failed"]
    assert [(e["data"]["rank"], e["data"]["reason"]) for e in failed] == [(rank, "hang")], failed
    culprit_node = agents["a" if rank < 2 else "b"]
    assert "what each is doing (the server decides whether the job hangs)" in culprit_node.output
    if fault == "deadlock":     # the call that differs, from the stacks
        calls = {r["rank"]: r.get("call") for r in hang[0]["data"]["ranks"]}
        assert calls == {0: "barrier", 1: "barrier", 2: "barrier", 3: "recv"}, calls
        assert hang[0]["data"]["odd"] == [3] and "rank 3 waits in recv" in hang[0]["message"], hang
    if fault == "sleep":        # shown as alone first, then decided at the limit
        assert hang[0]["data"]["capped"] and hang[0]["data"]["limit_s"] == 8.0, hang
        assert any(e["kind"] == "ranks_alone" and e["data"]["culprit"] == rank for e in events), events


def test_a_solo_spell_decided_a_hang_once_is_never_decided_again_at_that_place(cluster, tmp_path):
    """Rank 1 uploads alone for 14 s at step 10 of every attempt: the first is taken for a hang at the 6 s limit,
    the same place after the restart is excused, and the job finishes on one restart."""
    job = "solo"
    agents = start_pair(cluster, tmp_path, job, {"FAULT": "solo", "FAULT_RANK": "1", "FAULT_STEP": "10",
                                                 "SOLO_S": "14", "STEPS": "14"}, "--hang-alone-timeout", "6")
    view = finish(agents, cluster, job)
    assert view["state"] == "succeeded" and view["restart_count"] == 1, view
    events = job_events(cluster, job)
    assert [e["data"]["culprit"] for e in events if e["kind"] == "hang_detected"] == [1], events
    excused = [e for e in events if e["kind"] == "hang_excused"]
    assert len(excused) == 1 and excused[0]["data"]["culprit"] == 1 and excused[0]["data"]["excused_round"] >= 1
    assert "never decided a hang there again" in excused[0]["message"]


def test_ranks_that_compute_past_the_threshold_are_left_alone(cluster, tmp_path):
    job = "busy"
    # Every rank evaluates 7 s, then rank 0 writes alone for 16 s: the first look (from 5 s) may fall on the
    # switch from one to the other, and the look re-sent on the next wall-clock tick (2.5-7.5 s later) falls
    # inside the write, whatever the tick's phase.
    agents = start_pair(cluster, tmp_path, job, {"FAULT": "busy", "EVAL_EVERY": "10", "EVAL_S": "7", "BUSY_S": "16",
                                                 "STEPS": "14"})
    view = finish(agents, cluster, job)
    assert view["state"] == "succeeded" and view["restart_count"] == 0, view
    events = job_events(cluster, job)
    assert not [e for e in events if e["kind"] in ("hang_detected", "worker_failed")]
    said = agents["a"].output + agents["b"].output
    assert "what each is doing" in said and ": working" in said, said       # looked at, and left alone
    alone = [e for e in events if e["kind"] == "ranks_alone"]               # the checkpoint: rank 0 alone, shown
    assert alone and alone[0]["data"]["culprit"] == 0, events
    assert "rank 0 working (shown, not judged)" in alone[0]["message"], events
    assert "the server sees: rank 0 alone for" in said, said
