"""End-to-end suspect nodes (issue 55): a worker that exits with a code asking for other hardware (Megatron's 16)
has its node replaced by a ready spare at its first such exit, the spare resuming that node's ranks from the peer
copy of their snapshots; with no spare the job restarts on the same nodes once, and a second such exit of the node
excludes it rather than looping. Real server and agents on 127.0.0.1 (each node its own failure domain), 2 gloo
workers per node running benchmarks/scripts/shard_train.py."""
from __future__ import annotations

import datetime
import os
import signal
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


@pytest.mark.parametrize("domains", ["each node its own", "one for all"])
def test_a_slow_node_is_swapped_for_the_spare_at_the_next_snapshot_with_nothing_redone(cluster, tmp_path, domains):
    """Node b sleeps half a step more every step (as slow storage would): it is named slow by the time the others
    wait on it, the job's ranks hold after their next snapshot, and the spare takes b's place and ranks, every rank
    resuming from that snapshot: no step redone, no restart spent, b held out. The spare fetches b's snapshots from
    b itself, so it needs no peer copy: in one failure domain (peer copies off) as well."""
    cluster.start_server()
    env = {"SLOW_AT": "b:0:0.5:sleep"}
    extra = ("--nnodes", "2", "--replace-slow-nodes",
             *(("--failure-domain", "one-rack") if domains == "one for all" else ()))
    agents = {n: start(cluster, tmp_path, n, "slow", extra=extra, env=env) for n in ("a", "b")}
    wait_until(lambda: len({r for *_, r, _ in steps(tmp_path)}) >= 4, LIMIT, "every rank stepping")
    place = next(n["group_rank"] for n in job_view(cluster, "slow")["nodes"] if n["node_id"] == "b")
    agents["s"] = start(cluster, tmp_path, "s", "slow", extra=extra, env=env)
    swapped = wait_until(lambda: next((e for e in job_events(cluster, "slow") if e["kind"] == "node_suspect"
                                       and "swapped for spare s" in e["message"]), None), LIMIT,
                         lambda: f"b swapped: {job_events(cluster, 'slow')}")
    assert "at the snapshot of step " in swapped["message"], swapped
    held = int(swapped["message"].split("at the snapshot of step ")[1].split()[0].rstrip(",;"))
    back = wait_until(lambda: len(shard_resumes(tmp_path, 0.0)) >= 4 and
                      {r: v for r, v in shard_resumes(tmp_path, 0.0).items() if v[0] > 0}, LIMIT,
                      lambda: f"every rank resumed: {shard_resumes(tmp_path, 0.0)}\n{agents['s'].output}")
    assert {step for step, _, _ in back.values()} == {held} and {s for _, s, _ in back.values()} == {"memory"}, back
    at = datetime.datetime.fromisoformat(swapped["time"].replace("Z", "+00:00")).timestamp()
    assert max(step for t, step, _, _ in steps(tmp_path) if t <= at) == held        # nobody got past it
    view = job_view(cluster, "slow")
    assert view["restart_count"] == 0 and {n["node_id"]: n["group_rank"] for n in view["nodes"]}["s"] == place
    assert [n["node_id"] for n in view["excluded"]] == ["b"], view
    agents["s"].wait_for_line(rf"fetched node b's snapshots of step {held} from ", LIMIT)
    finish(tmp_path, {n: a for n, a in agents.items() if n != "b"}, "b")


def test_a_slow_node_that_keeps_pace_again_before_the_snapshot_is_not_swapped(cluster, tmp_path):
    """Node b is slow from step 105 to 200 only (a neighbour's job on its host, say; long enough to be named,
    slow.SLOW_SPAN_S): named slow after the snapshot of step 150, its swap waits for the one of step 300; b keeps
    pace again before it, so the swap is called off: no new round, b stays a member (not excluded for a slowness it
    no longer has), s stays the spare."""
    cluster.start_server()
    env = {"SLOW_AT": "b:105:0.5:sleep:200", "SNAP_EVERY": "150"}
    extra = ("--nnodes", "2", "--replace-slow-nodes")
    agents = {n: start(cluster, tmp_path, n, "calm", extra=extra, env=env) for n in ("a", "b")}
    wait_until(lambda: len({r for *_, r, _ in steps(tmp_path)}) >= 4, LIMIT, "every rank stepping")
    agents["s"] = start(cluster, tmp_path, "s", "calm", extra=extra, env=env)
    agents["s"].wait_for_line(r"ready after", LIMIT)
    wait_until(lambda: any(e["kind"] == "node_pace_ok" for e in job_events(cluster, "calm")), LIMIT,
               lambda: f"b keeps pace again: {job_events(cluster, 'calm')}")
    wait_until(lambda: max(s for _, s, _, _ in steps(tmp_path)) >= 310, LIMIT, "past the snapshot of step 300")
    said = [(e["kind"], e["message"]) for e in job_events(cluster, "calm")
            if e["kind"] in ("node_suspect", "node_pace_ok", "node_excluded")]
    assert [k for k, _ in said] == ["node_suspect", "node_pace_ok"], said
    assert said[1][1] == "node b keeps pace again: its swap for a spare is called off", said
    view = job_view(cluster, "calm")
    assert view["round_id"] == 1 and {n["node_id"] for n in view["nodes"]} == {"a", "b"}, view
    assert [n["node_id"] for n in view["spares"]] == ["s"] and view["excluded"] == [], view
    finish(tmp_path, agents, "s")      # (the spare, whose workers never ran, exits 1)


def test_a_slow_node_swapped_out_comes_back_at_once_when_its_spare_is_lost(cluster, tmp_path):
    """The spare that took slow node b's place dies at once (its agent SIGKILLed): the job, short of nodes, does not
    sit out b's 60 s cooldown but readmits b, slow but working, and every rank resumes from the swap's snapshot."""
    cluster.start_server()
    env = {"SLOW_AT": "b:0:0.5:sleep"}
    extra = ("--nnodes", "2", "--replace-slow-nodes")
    agents = {n: start(cluster, tmp_path, n, "back", extra=extra, env=env) for n in ("a", "b")}
    wait_until(lambda: len({r for *_, r, _ in steps(tmp_path)}) >= 4, LIMIT, "every rank stepping")
    agents["s"] = start(cluster, tmp_path, "s", "back", extra=extra, env=env)
    swapped = wait_until(lambda: next((e for e in job_events(cluster, "back") if e["kind"] == "node_suspect"
                                       and "swapped for spare s" in e["message"]), None), LIMIT,
                         lambda: f"b swapped: {job_events(cluster, 'back')}", interval=0.02)
    killed_at = time.time()
    os.kill(agents["s"].pid, signal.SIGKILL)
    held = int(swapped["message"].split("at the snapshot of step ")[1].split()[0])
    said = wait_until(lambda: [e["message"] for e in job_events(cluster, "back") if e["kind"] == "node_readmitted"],
                      LIMIT, lambda: f"b readmitted: {job_events(cluster, 'back')}")
    assert said == ["node b's exclusion as a slow node swapped out ends: the job waits for nodes"], said
    view = wait_until(lambda: (v := job_view(cluster, "back"))["round_id"] == 3 and v, LIMIT, "round 3")
    assert {n["node_id"] for n in view["nodes"]} == {"a", "b"} and view["excluded"] == [], view
    back = wait_until(lambda: len(shard_resumes(tmp_path, killed_at)) == 4 and shard_resumes(tmp_path, killed_at),
                      LIMIT, lambda: f"every rank resumed: {shard_resumes(tmp_path, killed_at)}")
    assert {(step, source) for step, source, _ in back.values()} == {(held, "memory")}, back
    finish(tmp_path, agents, "s")
