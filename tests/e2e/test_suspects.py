"""End-to-end suspect nodes (issue 55): a worker that exits with a code asking for other hardware (Megatron's 16)
has its node replaced by a ready spare at its first such exit, the spare resuming that node's ranks from the peer
copy of their snapshots; with no spare the job restarts on the same nodes once, and a second such exit of the node
excludes it rather than looping. Real server and agents on 127.0.0.1 (each node its own failure domain), 2 gloo
workers per node running benchmarks/scripts/shard_train.py."""
from __future__ import annotations

import time

import pytest

from tests.e2e.harness import job_events, job_view, shard_resumes, wait_until
from tests.e2e.test_peer_copies import LIMIT, finish, start, steps

pytestmark = pytest.mark.e2e


def test_a_worker_asking_for_other_hardware_has_its_node_replaced_by_the_spare(cluster, tmp_path):
    cluster.start_server()
    env = {"EXIT_AT": "3:16"}           # global rank 3 (group rank 1's second worker) exits 16 once told (OUT_DIR/exit)
    agents = {n: start(cluster, tmp_path, n, "sus", extra=("--nnodes", "2"), env=env) for n in ("a", "b")}
    wait_until(lambda: len({r for *_, r, _ in steps(tmp_path)}) >= 4, LIMIT, "every rank stepping")
    agents["s"] = start(cluster, tmp_path, "s", "sus", extra=("--nnodes", "2"), env=env)
    agents["s"].wait_for_line(r"ready after", LIMIT)
    asked = next(n["node_id"] for n in job_view(cluster, "sus")["nodes"] if n["group_rank"] == 1)
    wait_until(lambda: next(n for n in job_view(cluster, "sus")["nodes"] if n["node_id"] == asked)
               .get("copies", {}).get("copied_step", -1) >= 10, LIMIT, f"node {asked}'s copies of step 10 or later")
    began = time.time()
    (tmp_path / "exit").write_text("now")
    back = wait_until(lambda: len(shard_resumes(tmp_path, began)) == 4 and shard_resumes(tmp_path, began), LIMIT,
                      lambda: f"every rank resumed: {shard_resumes(tmp_path, began)}\n{agents['s'].output}")
    assert {source for _, source, _ in back.values()} == {"memory"}, back
    assert len({step for step, _, _ in back.values()}) == 1 and {ok for _, _, ok in back.values()} == {"ok"}, back
    view = job_view(cluster, "sus")
    assert view["restart_count"] == 1, view
    assert {n["node_id"]: n["group_rank"] for n in view["nodes"]} == {"s": 1, ("a" if asked == "b" else "b"): 0}
    said = [e["message"] for e in job_events(cluster, "sus") if e["kind"] == "node_suspect"]
    assert len(said) == 1 and f"node {asked} is a suspect" in said[0] and "spare s takes its place" in said[0], said
    finish(tmp_path, {n: a for n, a in agents.items() if n != asked}, asked)
